package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// calls counts the calls an external step makes, per attempt of a key.
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) add(sc *saga.StepContext) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	k := saga.MessageID(sc.Key, sc.Attempt)
	c.n[k]++
	return c.n[k]
}

func (c *calls) of(key uuid.UUID, attempt int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[saga.MessageID(key, attempt)]
}

// external is a definition of one external step whose handler runs call.
func external(name string, call saga.HandlerFunc, compensate saga.HandlerFunc) *saga.Definition {
	return saga.MustNew(name, saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep, Forward: call, Compensate: compensate,
		Retry: saga.RetryPolicy{Timeout: 5 * time.Second}, CompensateRetry: saga.RetryPolicy{Timeout: 5 * time.Second}})
}

// TestExternalStepHoldsNothingDuringTheCall: the attempt's claim is
// committed before the call (another session sees it), and during the
// call the step holds no connection of its pool and no transaction open.
// The outcome then commits with its reply.
func TestExternalStepHoldsNothingDuringTheCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	pool := poolWith(t, shared, func(*pgxpool.Config) {}) // one connection
	var during struct {
		acquired int32
		outcome  string
		idleInTx int
		err      error
	}
	def := external("holds", func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		during.acquired = pool.Stat().AcquiredConns()
		during.err = errors.Join(
			shared.QueryRow(ctx, `select outcome::text from idemsaga.inbox where step_key = $1`, pguuid.Of(sc.Key)).Scan(&during.outcome),
			shared.QueryRow(ctx, `select count(*) from pg_stat_activity where datname = current_database() and state like 'idle in transaction%'`).Scan(&during.idleInTx))
		if sc.Tx != nil {
			return nil, errors.New("an external step got a transaction")
		}
		return json.RawMessage(`{"charge":"ch-1"}`), nil
	}, nil)
	id := testenv.NewSaga(t, shared, "holds")
	reply, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "holds", "call", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	require.NoError(t, during.err)
	require.Zero(t, during.acquired, "no connection held during the call")
	require.Zero(t, during.idleInTx, "no transaction open during the call")
	require.Equal(t, "started", during.outcome, "the claim committed before the call")
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.JSONEq(t, `{"charge":"ch-1"}`, string(reply.Result))
	outcome, attempt, unknown := inbox(t, shared, id, reply.Key)
	require.Equal(t, []any{"succeeded", 1, false}, []any{outcome, attempt, unknown})
	var replies int
	require.NoError(t, shared.QueryRow(ctx, `select count(*) from idemsaga.outbox where saga_id = $1`, pguuid.Of(id)).Scan(&replies))
	require.Equal(t, 1, replies)
}

// TestExternalDuplicatesCallOncePerAttempt delivers one external command
// from 32 goroutines at once, half as redeliveries, to a worker that
// remembers nothing: the other system is called once for the attempt,
// and every other delivery is answered from the inbox or, while the call
// runs, writes nothing. Then attempt 2 (its lease taken over, say), from
// 16 goroutines: one call for it, none for attempt 1. Then a third
// attempt, after a success: answered from the inbox, no call.
func TestExternalDuplicatesCallOncePerAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	var c calls
	def := external("once", func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		c.add(sc)
		time.Sleep(20 * time.Millisecond) // the call takes a while: duplicates arrive during it
		if sc.Attempt == 1 {
			return nil, errors.New("connection reset by peer") // unknown: it may have charged
		}
		return json.RawMessage(`{"ok":true}`), nil
	}, nil)
	w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	id := testenv.NewSaga(t, pool, "once")
	key := saga.StepKey(id, "call", saga.PhaseForward)

	replies := handleAtOnce(t, w, testenv.Command(id, "once", "call", saga.PhaseForward, 1, 1), 32)
	require.Equal(t, 1, c.of(key, 1), "one call for attempt 1")
	fresh := 0
	for _, r := range replies {
		if !r.Duplicate {
			fresh++
			require.Equal(t, wire.OutcomeUnknown, r.Outcome)
		}
	}
	require.Equal(t, 1, fresh)
	outcome, attempt, unknown := inbox(t, pool, id, key)
	require.Equal(t, []any{"retry", 1, true}, []any{outcome, attempt, unknown}, "attempt 1 ended with an unknown outcome")

	replies = handleAtOnce(t, w, testenv.Command(id, "once", "call", saga.PhaseForward, 2, 1), 16)
	require.Equal(t, 1, c.of(key, 2), "one call for attempt 2")
	require.Equal(t, 1, c.of(key, 1), "and still one for attempt 1")
	fresh = 0
	for _, r := range replies {
		if !r.Duplicate {
			fresh++
			require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
		}
	}
	require.Equal(t, 1, fresh)
	outcome, attempt, unknown = inbox(t, pool, id, key)
	require.Equal(t, []any{"succeeded", 2, true}, []any{outcome, attempt, unknown}, "it stays known that an attempt's outcome was unknown")

	r, err := w.Handle(ctx, testenv.Command(id, "once", "call", saga.PhaseForward, 3, 1))
	require.NoError(t, err)
	require.True(t, r.Duplicate)
	require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
	require.JSONEq(t, `{"ok":true}`, string(r.Result))
	require.Zero(t, c.of(key, 3), "no call after a success")
}

// TestExternalOutcomes: what each way a call can end is recorded as, in
// the inbox and in the reply.
func TestExternalOutcomes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		call    saga.HandlerFunc
		reply   wire.Outcome
		inbox   string
		unknown bool
	}{
		{"a success", func(context.Context, *saga.StepContext) (json.RawMessage, error) { return json.RawMessage(`1`), nil },
			wire.OutcomeSucceeded, "succeeded", false},
		{"a refusal for good", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, saga.Permanent(errors.New("card declined"))
		}, wire.OutcomeFailed, "failed", false},
		{"not applied, retry", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, saga.NotApplied(errors.New("503: nothing charged"))
		}, wire.OutcomeRetry, "retry", false},
		{"a transport error", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, errors.New("read tcp: connection reset by peer")
		}, wire.OutcomeUnknown, "retry", true},
		{"a 500", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, fmt.Errorf("payment service answered 500 Internal Server Error")
		}, wire.OutcomeUnknown, "retry", true},
		{"a panic", func(context.Context, *saga.StepContext) (json.RawMessage, error) { panic("handler bug") },
			wire.OutcomeUnknown, "retry", true},
		{"the attempt's timeout", func(ctx context.Context, _ *saga.StepContext) (json.RawMessage, error) {
			<-ctx.Done() // the call outlives the step's Timeout
			return nil, fmt.Errorf("call: %w", ctx.Err())
		}, wire.OutcomeUnknown, "retry", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			def := saga.MustNew("outcomes", saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep, Forward: tc.call,
				Retry: saga.RetryPolicy{Timeout: 200 * time.Millisecond}})
			id := testenv.NewSaga(t, pool, "outcomes")
			reply, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "outcomes", "call", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, tc.reply, reply.Outcome, reply.Error)
			require.False(t, reply.Duplicate)
			outcome, attempt, unknown := inbox(t, pool, id, reply.Key)
			require.Equal(t, []any{tc.inbox, 1, tc.unknown}, []any{outcome, attempt, unknown})
			var payload []byte
			require.NoError(t, pool.QueryRow(ctx, `select payload from idemsaga.outbox where saga_id = $1`, pguuid.Of(id)).Scan(&payload))
			r, err := wire.DecodeReply(payload)
			require.NoError(t, err)
			require.Equal(t, tc.reply, r.Outcome, "the reply written says the same")
		})
	}
}

// TestExternalAttemptTakenOverIsUnknown: attempt 1 claimed its call and
// its process died before recording an outcome (the row stays started).
// Attempt 2 takes the key over: attempt 1's outcome is now unknown, and
// stays known as such after attempt 2 succeeds.
func TestExternalAttemptTakenOverIsUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	var c calls
	def := external("crashed", func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		c.add(sc)
		return json.RawMessage(`"charged"`), nil
	}, nil)
	id := testenv.NewSaga(t, pool, "crashed")
	key := saga.StepKey(id, "call", saga.PhaseForward)
	_, err := pool.Exec(ctx, `insert into idemsaga.inbox (saga_id, step_key, step, phase, attempt, outcome) values ($1, $2, 'call', 'forward', 1, 'started')`, pguuid.Of(id), pguuid.Of(key))
	require.NoError(t, err)

	w := newWorker(t, pool, def)
	r, err := w.Handle(ctx, testenv.Command(id, "crashed", "call", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	require.True(t, r.Duplicate, "attempt 1 is claimed already: its delivery does not call")
	require.Zero(t, c.of(key, 1))

	r, err = w.Handle(ctx, testenv.Command(id, "crashed", "call", saga.PhaseForward, 2, 1))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
	require.Equal(t, 1, c.of(key, 2))
	outcome, attempt, unknown := inbox(t, pool, id, key)
	require.Equal(t, []any{"succeeded", 2, true}, []any{outcome, attempt, unknown})
}

// TestExternalOutcomeAfterGiveUpIsNotRecorded: while a call runs, the
// engine gives the step up (its tombstone: the lease expired). The call
// then succeeds, and its outcome is not recorded: the key stays fenced, and
// nothing is written for the attempt.
func TestExternalOutcomeAfterGiveUpIsNotRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	calling, release := make(chan struct{}), make(chan struct{})
	def := external("late", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
		close(calling)
		<-release
		return json.RawMessage(`"charged"`), nil
	}, nil)
	id := testenv.NewSaga(t, pool, "late")
	key := saga.StepKey(id, "call", saga.PhaseForward)
	done := make(chan wire.Reply, 1)
	go func() {
		r, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "late", "call", saga.PhaseForward, 1, 1))
		if err != nil {
			r.Error = "handle: " + err.Error()
		}
		done <- r
	}()
	<-calling
	// What the engine's settle does to a started call it gives up.
	_, err := pool.Exec(ctx, `update idemsaga.inbox set outcome = 'tombstone', unknown = true where saga_id = $1 and step_key = $2`, pguuid.Of(id), pguuid.Of(key))
	require.NoError(t, err)
	close(release)
	r := <-done
	require.NotContains(t, r.Error, "handle:")
	require.True(t, r.Duplicate, "the late outcome is not recorded")
	outcome, _, unknown := inbox(t, pool, id, key)
	require.Equal(t, []any{"tombstone", true}, []any{outcome, unknown})
	var replies int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where saga_id = $1`, pguuid.Of(id)).Scan(&replies))
	require.Zero(t, replies)
}

// TestExternalCompensationRunsWhenTheForwardStepMayHaveTakenEffect: a
// compensation fences the forward key and runs only if the forward step
// took effect (with its result) or may have (ForwardUnknown, no result);
// a forward step that never called, or was refused, is not undone. A late
// forward delivery after the fence does not call.
func TestExternalCompensationRunsWhenTheForwardStepMayHaveTakenEffect(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// forward sets up what the forward key holds.
		forward string // SQL values: outcome, unknown, result; "" for nothing
		undo    bool
		unknown bool
		result  string
	}{
		{name: "never called", undo: false},
		{name: "succeeded", forward: `'succeeded', false, '{"charge":"ch-9"}'`, undo: true, result: `{"charge":"ch-9"}`},
		{name: "refused", forward: `'failed', false, null`, undo: false},
		{name: "retried, known not applied", forward: `'retry', false, null`, undo: false},
		{name: "an unknown outcome", forward: `'retry', true, null`, undo: true, unknown: true},
		{name: "a call in flight or whose process died", forward: `'started', false, null`, undo: true, unknown: true},
		{name: "refused after an unknown outcome", forward: `'failed', true, null`, undo: true, unknown: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			var forwardCalls, refunds atomic.Int32
			var seen *saga.StepContext
			def := external("comp", func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				forwardCalls.Add(1)
				return nil, nil
			}, func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				refunds.Add(1)
				seen = sc
				return json.RawMessage(`"refunded"`), nil
			})
			id := testenv.NewSaga(t, pool, "comp")
			fwdKey := saga.StepKey(id, "call", saga.PhaseForward)
			if tc.forward != "" {
				_, err := pool.Exec(ctx, `insert into idemsaga.inbox (saga_id, step_key, step, phase, attempt, outcome, unknown, result)
values ($1, $2, 'call', 'forward', 3, `+tc.forward+`)`, pguuid.Of(id), pguuid.Of(fwdKey))
				require.NoError(t, err)
			}
			w := newWorker(t, pool, def)
			r, err := w.Handle(ctx, testenv.Command(id, "comp", "call", saga.PhaseCompensate, 1, 1))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
			if !tc.undo {
				require.Zero(t, refunds.Load(), "nothing to undo")
			} else {
				require.Equal(t, int32(1), refunds.Load())
				require.Equal(t, fwdKey, seen.ForwardKey)
				require.Equal(t, tc.unknown, seen.ForwardUnknown)
				if tc.result != "" {
					require.JSONEq(t, tc.result, string(seen.Results["call"]))
				} else {
					require.NotContains(t, seen.Results, "call")
				}
			}
			// A late forward delivery does not call.
			late, err := w.Handle(ctx, testenv.Command(id, "comp", "call", saga.PhaseForward, 4, 1))
			require.NoError(t, err)
			require.True(t, late.Duplicate)
			require.Zero(t, forwardCalls.Load(), "the forward key is fenced")
		})
	}
}
