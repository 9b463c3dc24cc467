package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestStartCarriesItsFirstStep: transfers started through the engine's own
// client, 16 at once with every tenth submitted twice, each commit with
// the first attempt of their first step, in one transaction, and cross no
// broker; every tenth is compensated; money is conserved.
func TestStartCarriesItsFirstStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	reg := prometheus.NewRegistry()
	// Slots for every start in flight, and the steps they lead to.
	e := startEngine(t, pool, nc, testenv.Name("CARRY"), []*saga.Definition{def}, func(c *engine.Config) {
		c.Registerer = reg
		c.StepConcurrency = 64
	})

	const n = 200
	credited, compensated := submitTransfers(t, def, n, e.Client())
	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	require.Equal(t, n, countRows(t, ctx, pool, testenv.CarriedSQL), "every start committed with its first step")
	require.Equal(t, float64(n), metricSum(t, reg, "idemsaga_sagas_started_total", nil))
	require.Equal(t, float64(n/10), metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "start"}))
	require.Zero(t, metricSum(t, reg, "idemsaga_outbox_published_total", nil), "no message crossed the broker")
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.step_attempts where attempt > 1 or outcome <> 'succeeded'`))
}

// TestCarriedStartsOfOneKey: 24 starts of one key at once, through the
// engine's own client, make one saga and one deduction; one of them
// started it, the others are duplicates of it; a start of the key with
// another input is refused and writes nothing.
func TestCarriedStartsOfOneKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	e := startEngine(t, pool, nc, testenv.Name("CARRYKEY"), []*saga.Definition{def}, func(c *engine.Config) { c.StepConcurrency = 32 })

	const starts = 24
	results := make([]engine.StartResult, starts)
	var wg sync.WaitGroup
	release := make(chan struct{})
	for i := range starts {
		wg.Go(func() {
			<-release
			var err error
			results[i], err = e.Client().Start(ctx, def, "one-key", transferInput(1, 2, 7))
			require.NoError(t, err)
		})
	}
	close(release)
	wg.Wait()
	fresh := 0
	for _, r := range results {
		require.Equal(t, results[0].ID, r.ID)
		if !r.Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one start made the saga")
	_, err := e.Client().Start(ctx, def, "one-key", transferInput(1, 2, 8))
	require.ErrorIs(t, err, saga.ErrIdempotencyKeyReused)

	waitAllFinished(t, pool, time.Minute)
	requireConserved(t, pool, seeded)
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas`))
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from fixture.ledger where step = 'deduct'`))
	require.Equal(t, 1, countRows(t, ctx, pool, testenv.CarriedSQL))
}

// TestCarriedFirstStepFailsForGood: of 24 transfers started at once, the
// 8 from a frozen account fail their first step for good; each failure
// commits with its saga's start, in the same transaction, while the
// others' deductions commit with theirs.
func TestCarriedFirstStepFailsForGood(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool) // account 51 is frozen
	e := startEngine(t, pool, nc, testenv.Name("CARRYFAIL"), []*saga.Definition{def}, func(c *engine.Config) { c.StepConcurrency = 32 })

	const n = 24
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			from := int64(1 + i%50)
			if i%3 == 0 {
				from = 51
			}
			res, err := e.Client().Start(ctx, def, key(i), transferInput(from, 1+int64(i+1)%50, 5))
			require.NoError(t, err, "a first step that fails is the saga's outcome, not the start's")
			ids[i] = res.ID
		})
	}
	wg.Wait()
	waitAllFinished(t, pool, time.Minute)
	for i, id := range ids {
		sg, err := e.Client().Get(ctx, id)
		require.NoError(t, err)
		if i%3 == 0 {
			require.Equal(t, saga.StateCompensated, sg.State, "saga %d: nothing took effect, nothing to undo", i)
			require.Contains(t, sg.Error, "frozen")
			continue
		}
		require.Equal(t, saga.State("credited"), sg.State, "saga %d", i)
	}
	require.Equal(t, n, countRows(t, ctx, pool, testenv.CarriedSQL), "each outcome, failure or success, committed with its start")
	require.Equal(t, n/3, countRows(t, ctx, pool, testenv.CarriedSQL+` and st.status = 'failed'`))
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from fixture.ledger l join idemsaga.sagas s on s.id = l.saga_id where s.state = 'failed'`),
		"a failed deduction wrote nothing")
	requireConserved(t, pool, seeded)
}

// requireConserved checks the fixture's audit: no money made or lost, and
// every ledger line's saga's.
func requireConserved(t *testing.T, pool *pgxpool.Pool, seeded int64) {
	t.Helper()
	rep, err := fixture.Audit(context.Background(), pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}

// TestCarriedStartCallerGivesUp: a caller whose context ends while its
// saga's first step runs gets an error at once; the step goes on, commits
// with the start at its first attempt, and the same key then answers.
func TestCarriedStartCallerGivesUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	entered, gate := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	def := saga.MustNew("slowfirst",
		saga.Step{Name: "a", Reaches: "a_done", Kind: saga.DatabaseStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				if calls.Add(1) == 1 {
					close(entered)
					<-gate
				}
				return json.RawMessage(`"a"`), nil
			}},
	)
	e := startEngine(t, pool, nc, testenv.Name("CARRYGONE"), []*saga.Definition{def})

	short, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		_, err := e.Client().Start(short, def, "k", 1)
		errc <- err
	}()
	<-entered
	cancel()
	err := <-errc
	require.ErrorIs(t, err, context.Canceled)
	require.Contains(t, err.Error(), "start it again with the same key")
	close(gate)

	var res engine.StartResult
	require.Eventually(t, func() bool {
		res, err = e.Client().Start(ctx, def, "k", 1)
		require.NoError(t, err)
		return res.Duplicate
	}, 20*time.Second, 10*time.Millisecond)
	sg, err := e.Client().Wait(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("a_done"), sg.State)
	require.Equal(t, 1, sg.Steps[0].Attempt, "the caller's end spent no attempt")
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, countRows(t, ctx, pool, testenv.CarriedSQL))
}

// TestCarriedStartFailpoint: the first carried attempts fail after their
// claim (failpoint step-after-inbox): nothing of them commits, each start
// goes on alone, and every saga still deducts and credits once. Not
// parallel: failpoints are the process's.
func TestCarriedStartFailpoint(t *testing.T) {
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	e := startEngine(t, pool, nc, testenv.Name("CARRYFP"), []*saga.Definition{def}, func(c *engine.Config) { c.StepConcurrency = 32 })

	require.NoError(t, failpoint.Enable(failpoint.StepAfterInbox+"=error*4"))
	defer failpoint.Disable()
	const n = 12
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			res, err := e.Client().Start(ctx, def, key(i), transferInput(int64(1+i), int64(20+i), 3))
			require.NoError(t, err)
			require.False(t, res.Duplicate, "a start that went on alone is still the start of its saga")
		})
	}
	wg.Wait()
	waitAllFinished(t, pool, time.Minute)
	require.EqualValues(t, 4, failpoint.Hits(failpoint.StepAfterInbox))
	requireConserved(t, pool, seeded)
	require.Equal(t, n, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas where state = 'credited'`))
	require.Equal(t, n, countRows(t, ctx, pool, `select count(*) from fixture.ledger where step = 'deduct'`))
	carried := countRows(t, ctx, pool, testenv.CarriedSQL)
	require.Less(t, carried, n, "a start whose carried attempt failed committed alone")
	require.GreaterOrEqual(t, carried, n-4)
}

// TestCarriedAttemptsThatDoNotSucceedAtOnce: a carried first attempt
// that ends any other way than in success still leaves its step's row,
// which the start left to it: a retry, a failure for good, a handler that
// commits the step's transaction itself and one that rolls it back, each
// started 3 times at once. Every saga ends, with the effect of its first
// step at most once, and its step's row as a start alone would have had;
// none waits for its lease.
func TestCarriedAttemptsThatDoNotSucceedAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid not null, attempt int not null)`)
	require.NoError(t, err)
	type in struct{ Mode string }
	first := func(ctx context.Context, sc *saga.StepContext, x in) (int, error) {
		if _, err := sc.Tx.Exec(ctx, `insert into effects values ($1, $2)`, sc.SagaID, sc.Attempt); err != nil {
			return 0, err
		}
		switch {
		case x.Mode == "retry" && sc.Attempt == 1:
			return 0, errors.New("not yet")
		case x.Mode == "fail":
			return 0, saga.Permanent(errors.New("never"))
		case (x.Mode == "commit" || x.Mode == "rollback") && sc.Attempt == 1:
			_, err := sc.Tx.Exec(ctx, x.Mode)
			return 0, err
		}
		return sc.Attempt, nil
	}
	def, err := saga.New("carryodd",
		saga.Step{Name: "first", Reaches: "firsted", Kind: saga.DatabaseStep, Retry: fastPolicy, CompensateRetry: fastPolicy,
			Forward: saga.Handle(first), Compensate: saga.Handle(func(context.Context, *saga.StepContext, in) (int, error) { return 0, nil })},
		saga.Step{Name: "second", Reaches: "done", Kind: saga.DatabaseStep, Retry: fastPolicy,
			Forward: saga.Handle(func(context.Context, *saga.StepContext, in) (int, error) { return 0, nil })},
	)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, testenv.Name("CARRYODD"), []*saga.Definition{def}, func(c *engine.Config) {
		c.StepConcurrency, c.Registerer = 32, reg
	})

	modes := []string{"ok", "retry", "fail", "commit", "rollback"}
	var wg sync.WaitGroup
	for _, mode := range modes {
		for range 3 {
			wg.Go(func() {
				_, err := e.Client().Start(ctx, def, mode, in{Mode: mode})
				require.NoError(t, err, mode)
			})
		}
	}
	wg.Wait()
	waitAllFinished(t, pool, time.Minute)
	for _, mode := range modes {
		var state, status string
		var attempt, effects int
		require.NoError(t, pool.QueryRow(ctx, `select s.state::text, st.status::text, st.attempt,
  (select count(*) from effects f where f.saga_id = s.id)
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id and st.step = 'first' and st.phase = 'forward'
where s.idem_key = $1`, mode).Scan(&state, &status, &attempt, &effects), mode)
		want := map[string][4]any{
			"ok":       {"done", "succeeded", 1, 1},
			"retry":    {"done", "succeeded", 2, 1},
			"fail":     {string(saga.StateCompensated), "failed", 1, 0},
			"commit":   {"done", "succeeded", 1, 1},
			"rollback": {string(saga.StateCompensated), "failed", 1, 0},
		}[mode]
		require.Equal(t, want, [4]any{state, status, attempt, effects}, mode)
	}
	require.Equal(t, 1, countRows(t, ctx, pool, testenv.CarriedSQL+` and s.idem_key = 'ok'`), "the success committed with its start")
	// The reaper counts what it acts on before its commit, which comes
	// before the saga it moved can finish.
	require.Zero(t, metricSum(t, reg, "idemsaga_commands_requeued_total", nil), "every outcome moved its saga at once, none waited for its lease")
	runOut, err := testenv.LeasesRunOut(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, runOut)
}
