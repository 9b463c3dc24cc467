package sagatest_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// ledger is a stand-in for another system that deduplicates by the
// idempotency key it is given, as a payment service does.
type ledger struct {
	mu      sync.Mutex
	calls   int
	applied map[string]int
}

func (l *ledger) charge(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	if l.applied == nil {
		l.applied = map[string]int{}
	}
	l.applied[key]++
}

// TestBackoffsTakeNoWallTime: a step that fails four times, with
// exponential backoff up to a minute between attempts, then succeeds.
// The saga spends about two minutes of engine time and finishes at once.
func TestBackoffsTakeNoWallTime(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[int]int{}
	def := saga.MustNew("flaky", saga.Step{
		Name: "call", Reaches: "called", Kind: saga.DatabaseStep,
		Retry: saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 8 * time.Second, MaxBackoff: time.Minute, Jitter: -1},
		Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			mu.Lock()
			runs[sc.Attempt]++
			mu.Unlock()
			if sc.Attempt <= 4 {
				return nil, errors.New("not yet")
			}
			return json.RawMessage(`"done"`), nil
		},
	})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	began := time.Now()
	sg := env.Run(t, def, "flaky-1", map[string]int{"n": 1})
	wall := time.Since(began)

	require.Equal(t, saga.State("called"), sg.State)
	require.Len(t, sg.Attempts, 5)
	for i, a := range sg.Attempts {
		require.Equal(t, i+1, a.Attempt)
	}
	skipped, err := env.Clock.Offset(context.Background())
	require.NoError(t, err)
	// 8s + 16s + 32s + 60s of backoff, all skipped.
	require.GreaterOrEqual(t, skipped+wall, 116*time.Second)
	require.Less(t, skipped, 117*time.Second, "the clock moves to each due time, not past it")
	mu.Lock()
	defer mu.Unlock()
	// Moving the clock hands no command to the relay early: each attempt
	// was delivered, and ran, once.
	require.Equal(t, map[int]int{1: 1, 2: 1, 3: 1, 4: 1, 5: 1}, runs)
	t.Logf("5 attempts, %s of backoff skipped in %s of wall time", skipped, wall)
}

// TestFailingStepDeliveredTwiceRunsOncePerAttempt: every attempt of a
// database step that fails twice, then succeeds, is delivered twice at
// once, the copy to a runner that shares nothing with the first. The
// copies wait on the key while the first runs, and find its end when it
// lets the key go: each attempt's handler runs once, its failure decides
// the retry, and the effect is written once.
func TestFailingStepDeliveredTwiceRunsOncePerAttempt(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[int]int{}
	def := saga.MustNew("twice", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Retry: saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: time.Second, Jitter: -1},
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			mu.Lock()
			runs[sc.Attempt]++
			mu.Unlock()
			if _, err := sc.Tx.Exec(ctx, `insert into effects (step_key) values ($1)`, sc.Key); err != nil {
				return nil, err
			}
			if sc.Attempt <= 2 {
				return nil, errors.New("not yet")
			}
			return nil, nil
		},
	})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `create table effects (step_key uuid primary key)`)
		return err
	}})
	env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: "write", Times: 3})
	sg := env.Run(t, def, "twice-1", map[string]int{"n": 1})
	require.Equal(t, saga.State("written"), sg.State)
	require.Equal(t, 3, env.Fired(sagatest.DeliverTwice))
	mu.Lock()
	require.Equal(t, map[int]int{1: 1, 2: 1, 3: 1}, runs, "each attempt's handler ran once")
	mu.Unlock()
	require.Len(t, sg.Attempts, 3)
	var n int
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select count(*) from effects`).Scan(&n))
	require.Equal(t, 1, n)
}

func chargeDefinition(l *ledger, kind saga.StepKind) *saga.Definition {
	return saga.MustNew("pay",
		saga.Step{Name: "charge", Reaches: "charged", Kind: kind, Retry: saga.RetryPolicy{Timeout: 20 * time.Second},
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				l.charge(sc.Key.String())
				return nil, nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
		},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
	)
}

// TestLostOutcomeIsRetriedWithTheSameKey: an external call takes effect
// and its answer is lost; the lease runs out on the test clock, and the
// next attempt calls again with the same key, which the other system
// absorbs.
func TestLostOutcomeIsRetriedWithTheSameKey(t *testing.T) {
	t.Parallel()
	l := &ledger{}
	def := chargeDefinition(l, saga.ExternalStep)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 1})
	sg := env.Run(t, def, "order-1", map[string]int{"amount": 5})

	require.Equal(t, saga.State("shipped"), sg.State)
	require.Equal(t, 1, env.Fired(sagatest.LoseOutcome))
	require.Equal(t, 2, l.calls, "called twice")
	require.Len(t, l.applied, 1, "with one key")
	var charges []saga.StepAttempt
	for _, a := range sg.Attempts {
		if a.Step == "charge" {
			charges = append(charges, a)
		}
	}
	require.Len(t, charges, 2)
	require.Equal(t, charges[0].Key, charges[1].Key)
	require.Equal(t, 2, charges[1].Attempt)
	skipped, err := env.Clock.Offset(context.Background())
	require.NoError(t, err)
	require.GreaterOrEqual(t, skipped, 20*time.Second, "the first attempt's lease (timeout + grace) was skipped")
}

// TestCrashAfterCommitAndDoubleDeliveryTakeEffectOnce: a database step's
// worker dies right after its commit, and another step's command is
// delivered twice at once: every step's effect happens once.
func TestCrashAfterCommitAndDoubleDeliveryTakeEffectOnce(t *testing.T) {
	t.Parallel()
	var effects sync.Map
	count := func(sc *saga.StepContext) error {
		_, err := sc.Tx.Exec(context.Background(), `insert into effects (step_key) values ($1)`, sc.Key)
		return err
	}
	step := func(name, reaches string) saga.Step {
		return saga.Step{Name: name, Reaches: saga.State(reaches), Kind: saga.DatabaseStep,
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				effects.Store(name, true)
				return nil, count(sc)
			}}
	}
	def := saga.MustNew("two", step("first", "firsted"), step("second", "seconded"), step("third", "thirded"))
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def},
		Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, `create table effects (step_key uuid primary key)`)
			return err
		}})
	env.Inject(sagatest.Fault{Kind: sagatest.CrashAfterCommit, Step: "first"})
	env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: "second"})
	for i := range 5 {
		sg := env.Run(t, def, "k-"+string(rune('a'+i)), map[string]int{"i": i})
		require.Equal(t, saga.State("thirded"), sg.State)
	}
	require.Equal(t, 1, env.Fired(sagatest.CrashAfterCommit))
	require.Equal(t, 1, env.Fired(sagatest.DeliverTwice))
	var n int
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select count(*) from effects`).Scan(&n))
	require.Equal(t, 15, n, "five sagas, three steps each, each step's write once (a second would violate the key)")
	var odd []string
	rows, err := env.Pool.Query(context.Background(), `select step || ' ' || attempt || ' ' || coalesce(outcome, 'none') from idemsaga.step_attempts where outcome is distinct from 'succeeded'`)
	require.NoError(t, err)
	odd, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	// The crash took with it the dispatch of the next step, which only the
	// dead worker knew to run: its lease ran out (on the test clock) with
	// no worker having claimed it, and it was sent again at attempt 1.
	// Every attempt succeeded the first time; the second copy of a command
	// was absorbed.
	require.Empty(t, odd)
	var beyond int
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select count(*) from idemsaga.steps where attempt > 1`).Scan(&beyond))
	require.Zero(t, beyond, "the lost command cost no attempt")
}

// TestRetentionOnTheTestClock: a finished saga is kept for the replay
// window and deleted once the clock is past it.
func TestRetentionOnTheTestClock(t *testing.T) {
	t.Parallel()
	l := &ledger{}
	def := chargeDefinition(l, saga.DatabaseStep)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	env.Run(t, def, "old", map[string]int{"amount": 1})
	require.Zero(t, env.Clean(t).Sagas, "inside the window")
	require.NoError(t, env.Clock.Advance(context.Background(), 8*24*time.Hour))
	require.EqualValues(t, 1, env.Clean(t).Sagas)
	_, err := env.Client.Get(context.Background(), env.Run(t, def, "new", map[string]int{"amount": 2}).ID)
	require.NoError(t, err)
}
