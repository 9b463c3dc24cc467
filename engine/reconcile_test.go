package engine_test

import (
	"context"
	"strings"
	"testing"
	"time"

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

	// A step whose saga is gone (no foreign key guards it, migration 009).
	plant(`insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt)
values ('00000000-0000-0000-0000-00000000abcd', 'ghost', 'forward', 0, gen_random_uuid(), 'succeeded', 1)`)

	// A status no engine writes (no CHECK guards it, migration 011).
	plant(`update idemsaga.steps set status = 'dispatchd' where ctid = (select st.ctid from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id
where s.state = 'compensated' and st.phase = 'compensate' limit 1)`)

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
	require.Contains(t, all, "3 failed publishes, last: maximum payload exceeded")
	require.Contains(t, all, "failed and needs a person: refund rejected")
	require.Contains(t, all, "step or attempt without its saga: step ghost/forward")
	require.Contains(t, all, "status 'dispatchd'")
	for _, d := range diffs {
		if !strings.Contains(d.What, "outbox row") {
			require.NotNil(t, d.SagaID, "every saga difference names its saga: %s", d)
		}
	}
}
