package engine_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestReconcileCleanRunAndPlantedFaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	defs := []*saga.Definition{def}
	seedForLoad(t, pool)
	e := startEngine(t, pool, nc, testenv.Name("RECON"), defs)
	submitTransfers(t, def, 30, e.Client())
	waitAllFinished(t, pool, time.Minute)
	require.Eventually(t, func() bool {
		var n int
		_ = pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&n)
		return n == 0
	}, 10*time.Second, 10*time.Millisecond)

	diffs, err := engine.Reconcile(ctx, pool, defs, time.Second)
	require.NoError(t, err)
	require.Empty(t, diffs, "a clean run has no differences")

	plant := func(sql string) {
		t.Helper()
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err)
	}
	// A credited saga whose credit step is rewound to "failed" although the
	// inbox holds its success.
	plant(`update idemsaga.steps set status = 'failed' where ctid = (select st.ctid from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where s.state = 'credited' and st.step = 'credit' limit 1)`)
	// A running saga with nothing in flight.
	plant(`update idemsaga.sagas set finished_at = null where id = (select id from idemsaga.sagas where state = 'compensated' limit 1)`)
	// A row the broker never took.
	plant(`insert into idemsaga.outbox (subject, msg_id, payload, created_at, attempts, last_error) values ('x', 'x', '\x00', now() - interval '1 minute', 3, 'maximum payload exceeded')`)
	// A saga that needs a person: another credited saga than the first
	// plant's, whose difference would otherwise go with its state.
	plant(`update idemsaga.sagas set state = 'failed', error = 'refund rejected' where id = (select s.id from idemsaga.sagas s
where s.state = 'credited' and s.finished_at is not null
  and not exists (select 1 from idemsaga.steps st where st.saga_id = s.id and st.status = 'failed')
order by s.id desc limit 1)`)

	// A compensated saga whose failed step may have taken effect at
	// another system (an attempt's outcome was unknown) and was never
	// compensated: the charge the issue found left behind.
	plant(`update idemsaga.steps set possibly_done = true where ctid = (select st.ctid from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id
where s.state = 'compensated' and st.step = 'credit' and st.phase = 'forward' order by s.id limit 1)`)
	// A parked saga: a step that may have taken effect has no compensation.
	plant(`update idemsaga.sagas set state = 'parked', error = 'step notify may have taken effect' where id = (select s.id from idemsaga.sagas s
where s.state = 'credited' and not exists (select 1 from idemsaga.steps st where st.saga_id = s.id and st.status = 'failed')
order by s.id limit 1)`)

	// What the schema guards itself cannot be planted: a step whose saga
	// is gone, a status or an outcome no engine writes.
	for _, sql := range []string{
		`insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt)
values ('00000000-0000-0000-0000-00000000abcd', 'ghost', 'forward', 0, gen_random_uuid(), 'succeeded', 1)`,
		`update idemsaga.steps set status = 'dispatchd' where ctid = (select ctid from idemsaga.steps limit 1)`,
		`update idemsaga.inbox set outcome = 'done' where ctid = (select ctid from idemsaga.inbox limit 1)`,
		`update idemsaga.steps set phase = 'backward' where ctid = (select ctid from idemsaga.steps limit 1)`,
		`insert into idemsaga.inbox (saga_id, step_key, step, phase, attempt, outcome) values (gen_random_uuid(), gen_random_uuid(), 'x', 'forward', 1, 'succeeded')`,
		`update idemsaga.sagas set state = '' where id = (select id from idemsaga.sagas limit 1)`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.Error(t, err, sql)
	}

	diffs, err = engine.Reconcile(ctx, pool, defs, time.Second)
	require.NoError(t, err)
	var text []string
	for _, d := range diffs {
		text = append(text, d.String())
	}
	all := strings.Join(text, "\n")
	require.Contains(t, all, "step recorded as failed took effect: credit/forward")
	require.Contains(t, all, "in final state \"credited\" with 1 of 2 forward steps succeeded")
	require.Contains(t, all, "running (state compensated) with no step in flight: stuck")
	// The engine's relay may try the planted row again before reconcile
	// reads it (on a busy machine it does): the count and the error are
	// then its own.
	require.Regexp(t, `outbox row \d+ \(x\) unpublished for \d+s, \d+ failed publishes, last: \S`, all)
	require.Contains(t, all, "failed and needs a person: refund rejected")
	require.Contains(t, all, "compensated, but a step that may have taken effect was not compensated: credit (key ")
	require.Contains(t, all, "no compensation ran")
	require.Contains(t, all, "parked and needs a person: step notify may have taken effect")
	for _, d := range diffs {
		if !strings.Contains(d.What, "outbox row") {
			require.NotNil(t, d.SagaID, "every saga difference names its saga: %s", d)
		}
	}
}

// TestReconcileSaysWhenNoWorkerRunsADefinition: a lease nobody took over
// is reported with the likely reason, when no live worker runs the
// saga's definition.
func TestReconcileSaysWhenNoWorkerRunsADefinition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	other := saga.MustNew("other", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl := brokerClient(t, pool, testenv.Name("NOWORKER"), other)
	res, err := cl.Start(ctx, other, "o-1", map[string]int{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 hour' where saga_id = $1`, res.ID)
	require.NoError(t, err)
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{other}, time.Second)
	require.NoError(t, err)
	var found bool
	for _, d := range diffs {
		if strings.Contains(d.What, "lease expired and not taken over") {
			found = true
			require.Contains(t, d.What, "no live worker runs definition other")
		}
	}
	require.True(t, found, "%v", diffs)
}

// TestStateDifferencesMetric: the engine runs reconcile on its interval
// and sets idemsaga_state_differences by check: a stuck saga shows under
// "stuck" with every other check at 0, and the gauge goes back to 0 once
// it is gone.
func TestStateDifferencesMetric(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	reg := prometheus.NewRegistry()
	def := heldDefinition(t)
	startEngine(t, pool, nc, testenv.Name("RECMETRIC"), []*saga.Definition{def}, func(c *engine.Config) {
		c.Registerer, c.ReconcileInterval = reg, 20*time.Millisecond
	})
	runs := func() float64 {
		return metricSum(t, reg, "idemsaga_reconcile_runs_total", map[string]string{"outcome": "ok"})
	}
	gauge := func(check string) float64 {
		return metricSum(t, reg, "idemsaga_state_differences", map[string]string{"check": check})
	}
	require.Eventually(t, func() bool { return runs() >= 1 }, 30*time.Second, 10*time.Millisecond)
	for _, check := range engine.Checks {
		require.Zero(t, gauge(check), check)
	}

	// A running saga with no step in flight: what no writer leaves.
	stuck := testenv.NewSaga(t, pool, def.Name())
	after := runs()
	require.Eventually(t, func() bool { return runs() > after+1 && gauge("stuck") == 1 }, 30*time.Second, 10*time.Millisecond)
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, 0)
	require.NoError(t, err)
	require.Len(t, diffs, 1)
	require.Equal(t, "stuck", diffs[0].Check)
	for _, check := range engine.Checks {
		if check != "stuck" {
			require.Zero(t, gauge(check), check)
		}
	}

	_, err = pool.Exec(ctx, `delete from idemsaga.sagas where id = $1`, stuck)
	require.NoError(t, err)
	after = runs()
	require.Eventually(t, func() bool { return runs() > after+1 && gauge("stuck") == 0 }, 30*time.Second, 10*time.Millisecond)
}
