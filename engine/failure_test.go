package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// recorder is a step whose effect is a row in a table of the test, written
// in the step's transaction, so effects can be counted.
func recorder(name string, fail func(attempt int) error) saga.HandlerFunc {
	return func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if _, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step, phase) values ($1, $2, $3)`, sc.SagaID, name, sc.Phase); err != nil {
			return nil, err
		}
		if fail != nil {
			if err := fail(sc.Attempt); err != nil {
				return nil, err
			}
		}
		return json.RawMessage(`"` + name + `"`), nil
	}
}

func TestRetriesWaitForDueTimeThenSucceed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	def := saga.MustNew("flaky",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Forward: recorder("a", func(attempt int) error {
			if attempt < 3 {
				return errors.New("service unavailable")
			}
			return nil
		}), Retry: saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 30 * time.Millisecond, Jitter: -1}},
	)
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, testenv.Name("RETRY"), []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg })
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	sg := waitState(t, e.Client(), res.ID, "a_done")
	require.Equal(t, 3, sg.Steps[0].Attempt)
	require.GreaterOrEqual(t, sg.FinishedAt.Sub(sg.CreatedAt), 90*time.Millisecond, "two backoffs of 30ms and 60ms were waited")
	require.Equal(t, 2.0, metricSum(t, reg, "idemsaga_retries_scheduled_total", nil))
	var n int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects`).Scan(&n))
	require.Equal(t, 1, n, "failed attempts rolled back their writes")
}

func TestExhaustedRetriesCompensateInReverse(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text, at timestamptz default clock_timestamp())`)
	require.NoError(t, err)
	quick := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 5 * time.Millisecond, Timeout: 5 * time.Second}
	def := saga.MustNew("three",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Forward: recorder("a", nil), Compensate: recorder("a", nil), Retry: quick},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "b_done", Forward: recorder("b", nil), Retry: quick}, // nothing to undo
		saga.Step{Kind: saga.DatabaseStep, Name: "c", Reaches: "c_done", Forward: recorder("c", nil), Compensate: recorder("c", nil), Retry: quick},
		saga.Step{Kind: saga.DatabaseStep, Name: "d", Reaches: "d_done", Forward: recorder("d", func(int) error { return errors.New("always down") }), Retry: quick},
	)
	e := startEngine(t, pool, nc, testenv.Name("EXH"), []*saga.Definition{def})
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	sg := waitState(t, e.Client(), res.ID, saga.StateCompensated)
	require.Contains(t, sg.Error, "3 attempts exhausted")
	require.Contains(t, sg.Error, "always down")

	rows, err := pool.Query(ctx, `select step || '/' || phase from effects order by at`)
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		got = append(got, s)
	}
	require.Equal(t, []string{"a/forward", "b/forward", "c/forward", "c/compensate", "a/compensate"}, got,
		"completed steps are undone once each, in reverse; the failed step left no effect")
}

func TestCompensationThatCannotFinishEndsFailed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	quick := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond}
	def := saga.MustNew("stuck",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Forward: recorder("a", nil), Retry: quick, CompensateRetry: quick,
			Compensate: recorder("a", func(int) error { return errors.New("refund service rejects the call") })},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "b_done", Forward: recorder("b", func(int) error { return saga.Permanent(errors.New("declined")) }), Retry: quick},
	)
	e := startEngine(t, pool, nc, testenv.Name("STUCK"), []*saga.Definition{def})
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	sg := waitState(t, e.Client(), res.ID, saga.StateFailed) // a saga that cannot be compensated is visibly failed
	require.Contains(t, sg.Error, "refund service rejects the call")
	require.Contains(t, sg.Error, "a person must repair")
}

// TestUnknownOutcomeIsTombstonedAndCompensated: every attempt of a step
// hangs (a stalled worker that never replies). When the last lease
// expires, the step is given up; its compensation tombstones the key, so
// the stalled attempts, when they wake up, change nothing.
func TestUnknownOutcomeIsTombstonedAndCompensated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	release := make(chan struct{})
	var hung atomic.Int32
	hang := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if _, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step, phase) values ($1, 'b', 'forward')`, sc.SagaID); err != nil {
			return nil, err
		}
		hung.Add(1)
		<-release // ignores ctx, like a process stopped by SIGSTOP
		return json.RawMessage(`"late"`), nil
	}
	policy := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond, Timeout: 300 * time.Millisecond}
	// Step a's compensation is not under test: a roomy timeout keeps a
	// loaded machine (a commit's fsync stalling past 300 ms twice) from
	// ending the saga in failed instead.
	roomy := policy
	roomy.Timeout = 10 * time.Second
	def := saga.MustNew("hang",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Forward: recorder("a", nil), Compensate: recorder("a", nil), Retry: policy, CompensateRetry: roomy},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "b_done", Forward: hang, Retry: policy, CompensateRetry: policy},
	)
	var once sync.Once
	wake := func() { once.Do(func() { close(release) }) }
	defer wake() // before the engine's cleanup, which waits for handlers
	e := startEngine(t, pool, nc, testenv.Name("HANG"), []*saga.Definition{def}, func(c *engine.Config) { c.LeaseGrace = 200 * time.Millisecond })
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)

	// The stalled attempt holds the key uncommitted; the second attempt
	// waits behind it. When the last lease expires, the engine can settle
	// the step only once PostgreSQL ends the stalled session (idle in
	// transaction past the attempt's timeout plus a margin).
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	sg, err := e.Client().Wait(wctx, res.ID)
	require.NoError(t, err)
	require.GreaterOrEqual(t, hung.Load(), int32(1))
	wake() // the stalled handler returns into a dead transaction
	require.Equal(t, saga.StateCompensated, sg.State, "error: %s", sg.Error)
	require.Contains(t, sg.Error, "outcome unknown")
	var bEffects, aUndone int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) filter (where step = 'b'), count(*) filter (where step = 'a' and phase = 'compensate') from effects`).Scan(&bEffects, &aUndone))
	require.Zero(t, bEffects, "the abandoned step left no effect")
	require.Equal(t, 1, aUndone)
	var outcome string
	require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where step_key = $1`, saga.StepKey(res.ID, "b", saga.PhaseForward)).Scan(&outcome))
	require.Equal(t, "tombstone", outcome)
}

// TestTheLastUnknownAttemptStaysUnknown: an external step whose every
// attempt lost its answer is given up after the last one, and the
// timeline still says that attempt's outcome was unknown.
func TestTheLastUnknownAttemptStaysUnknown(t *testing.T) {
	t.Parallel()
	def := saga.MustNew("lossy", saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep, Retry: saga.RetryPolicy{MaxAttempts: 2},
		Forward:    func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, errors.New("no answer") },
		Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	sg := env.Run(t, def, "k", map[string]int{})
	require.Equal(t, saga.StateCompensated, sg.State)
	var outcomes []string
	for _, a := range sg.Attempts {
		if a.Phase == saga.PhaseForward {
			outcomes = append(outcomes, a.Outcome)
		}
	}
	require.Equal(t, []string{"unknown", "unknown"}, outcomes)
}
