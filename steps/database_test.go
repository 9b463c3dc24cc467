package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// writes is a database step whose handler makes n writes.
func writes(name string, n int, result json.RawMessage, err error) *saga.Definition {
	return saga.MustNew(name, saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			for range n {
				if err := writeEffect(ctx, sc); err != nil {
					return nil, err
				}
			}
			return result, err
		},
	})
}

// TestDatabaseStepRoundTrips counts what a database step sends once its
// connection is warm: BEGIN with the claim, each of the handler's
// statements, then the outcome with COMMIT. A duplicate costs the claim
// and one round trip that rolls it back and reads the stored outcome; a
// redelivery's duplicate, the read alone. None of it fails in PostgreSQL,
// so the statements stay prepared.
func TestDatabaseStepRoundTrips(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		statements int
		err        error
		outcome    wire.Outcome
	}{
		{"one statement", 1, nil, wire.OutcomeSucceeded},
		{"three statements", 3, nil, wire.OutcomeSucceeded},
		{"no statement", 0, nil, wire.OutcomeSucceeded},
		{"a refusal after a statement", 1, saga.Permanent(errors.New("declined")), wire.OutcomeFailed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips, shared := tracedEffectsDB(t)
			def := writes("trips", tc.statements, json.RawMessage(`{"n":1}`), tc.err)
			w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
			// Warm every statement of the paths measured.
			warm := testenv.Command(testenv.NewSaga(t, shared, "trips"), "trips", "write", saga.PhaseForward, 1, 1)
			for range 2 {
				_, err := w.Handle(ctx, warm)
				require.NoError(t, err)
			}
			_, err := w.HandleRedelivered(ctx, warm)
			require.NoError(t, err)
			cmd := testenv.Command(testenv.NewSaga(t, shared, "trips"), "trips", "write", saga.PhaseForward, 1, 1)
			trips.Reset()
			first, err := w.Handle(ctx, cmd)
			require.NoError(t, err)
			require.Equal(t, tc.outcome, first.Outcome)
			require.False(t, first.Duplicate)
			require.Equal(t, []int32{2, int32(tc.statements)}, []int32{trips.Batches.Load(), trips.Alone.Load()},
				"batches (BEGIN with the claim; the outcome with COMMIT, or the ROLLBACK with the failure's record), statements alone (the handler's): %q", trips.SentAlone())

			// A duplicate first delivery: the claim, then ROLLBACK with the
			// read of what the inbox holds.
			prepared := preparedStatements(t, pool)
			trips.Reset()
			dup, err := w.Handle(ctx, cmd)
			require.NoError(t, err)
			require.True(t, dup.Duplicate)
			require.Equal(t, tc.outcome, dup.Outcome)
			require.Equal(t, []int32{2, 0}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
			require.Equal(t, prepared, preparedStatements(t, pool), "a duplicate fails nothing: every statement stays prepared")

			// A duplicate redelivery: the read alone.
			trips.Reset()
			dup, err = w.HandleRedelivered(ctx, cmd)
			require.NoError(t, err)
			require.True(t, dup.Duplicate)
			require.Equal(t, tc.outcome, dup.Outcome)
			require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
			require.Contains(t, trips.SentAlone()[0], "select i.outcome", "the inbox is read, not claimed")

			want := 2 * tc.statements
			if tc.err != nil {
				want = 0
			}
			require.Equal(t, want, countEffects(t, pool))
			requireNoOpenTransaction(t, shared)
		})
	}
}

// preparedStatements counts the statements prepared on pool's one
// connection.
func preparedStatements(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from pg_prepared_statements`).Scan(&n))
	return n - 1 // not this query's own
}

// TestAFailedAttemptDoesNotRunAgain: an attempt whose handler failed
// (a retry) records that in the inbox under its key, with the rollback of
// its writes. Delivered again (a lost ack, the relay's copy of a command
// run at once, a resend), the same attempt answers from the inbox in one
// read and its handler does not run again; the next attempt claims the key
// and takes effect once.
func TestAFailedAttemptDoesNotRunAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, trips, shared := tracedEffectsDB(t)
	runs := map[int]int{}
	var mu sync.Mutex
	def := saga.MustNew("again", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			mu.Lock()
			runs[sc.Attempt]++
			mu.Unlock()
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			if sc.Attempt == 1 {
				return nil, errors.New("the first attempt fails")
			}
			return json.RawMessage(`{"n":1}`), nil
		},
	})
	w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	id := testenv.NewSaga(t, shared, "again")
	cmd := testenv.Command(id, "again", "write", saga.PhaseForward, 1, 1)
	reply, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeRetry, reply.Outcome, "the first delivery failed and committed nothing of the step")
	require.False(t, reply.Duplicate)
	outcome, attempt, _ := inbox(t, shared, id, cmd.Key)
	require.Equal(t, []any{"retry", 1}, []any{outcome, attempt}, "the key records that attempt 1 ended")
	require.Zero(t, countEffects(t, shared), "its write rolled back")

	trips.Reset()
	again, err := w.HandleRedelivered(ctx, cmd)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, wire.OutcomeRetry, again.Outcome)
	require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone (the read): %q", trips.SentAlone())
	again, err = w.Handle(ctx, cmd) // a copy that claims without reading first
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, wire.OutcomeRetry, again.Outcome)
	mu.Lock()
	require.Equal(t, map[int]int{1: 1}, runs, "attempt 1's handler ran once")
	mu.Unlock()

	next, err := w.Handle(ctx, testenv.Command(id, "again", "write", saga.PhaseForward, 2, 1))
	require.NoError(t, err)
	require.False(t, next.Duplicate)
	require.Equal(t, wire.OutcomeSucceeded, next.Outcome)
	require.JSONEq(t, `{"n":1}`, string(next.Result))
	outcome, attempt, _ = inbox(t, shared, id, cmd.Key)
	require.Equal(t, []any{"succeeded", 2}, []any{outcome, attempt})
	late, err := w.HandleRedelivered(ctx, cmd) // attempt 1 once more, after attempt 2 succeeded
	require.NoError(t, err)
	require.True(t, late.Duplicate)
	require.Equal(t, wire.OutcomeSucceeded, late.Outcome)
	require.Equal(t, 1, countEffects(t, shared), "one effect")
	mu.Lock()
	require.Equal(t, map[int]int{1: 1, 2: 1}, runs, "each attempt's handler ran once")
	mu.Unlock()
	requireNoOpenTransaction(t, shared)
}

// TestFailingAttemptDeliveredConcurrently delivers one command from 32
// goroutines at once to a worker that remembers nothing, its handler
// failing after a write (a retry): the deliveries that waited on the key
// while the first ran find its failure recorded when it lets the key go,
// so the handler runs once, one reply is fresh, and nothing takes effect.
func TestFailingAttemptDeliveredConcurrently(t *testing.T) {
	t.Parallel()
	pool := effectsDB(t)
	var runs atomic.Int32
	def := saga.MustNew("failing", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			runs.Add(1)
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			return nil, errors.New("the other bank is down")
		},
	})
	w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	id := testenv.NewSaga(t, pool, "failing")
	cmd := testenv.Command(id, "failing", "write", saga.PhaseForward, 1, 1)
	replies := handleAtOnce(t, w, cmd, 32)
	fresh := 0
	for _, r := range replies {
		require.Equal(t, wire.OutcomeRetry, r.Outcome)
		if !r.Duplicate {
			fresh++
			require.Equal(t, "the other bank is down", r.Error)
		}
	}
	require.Equal(t, 1, fresh, "one delivery recorded the failure")
	require.Equal(t, int32(1), runs.Load(), "the handler ran once")
	require.Zero(t, countEffects(t, pool))
	outcome, attempt, _ := inbox(t, pool, id, cmd.Key)
	require.Equal(t, []any{"retry", 1}, []any{outcome, attempt})
	var replyRows int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.outbox`).Scan(&replyRows))
	require.Equal(t, 1, replyRows, "one reply")
	requireNoOpenTransaction(t, pool)
}

// TestDuplicateThatWaitedOnTheClaim: a second delivery that reaches the
// inbox while the first still holds the key waits on it, and when the
// first commits, answers with what it committed, the result recorded after
// the claim included. The handler runs once.
func TestDuplicateThatWaitedOnTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := effectsDB(t)
	holding, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	def := saga.MustNew("waited", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			if runs.Add(1) == 1 {
				close(holding)
				<-release
			}
			return json.RawMessage(`{"n":7}`), nil
		},
	})
	cmd := testenv.Command(testenv.NewSaga(t, pool, "waited"), "waited", "write", saga.PhaseForward, 1, 1)

	first := make(chan error, 1)
	go func() {
		_, err := newWorker(t, pool, def).Handle(ctx, cmd)
		first <- err
	}()
	<-holding
	second := make(chan wire.Reply, 1)
	go func() {
		reply, err := newWorker(t, pool, def).Handle(ctx, cmd)
		if err != nil {
			reply.Error = "handle: " + err.Error()
		}
		second <- reply
	}()
	testenv.WaitForLockWaiters(t, pool, 1) // the second delivery waits on the key
	close(release)
	require.NoError(t, <-first)
	reply := <-second
	require.Empty(t, reply.Error)
	require.True(t, reply.Duplicate, "the inbox answers")
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.JSONEq(t, `{"n":7}`, string(reply.Result))
	require.Equal(t, 1, countEffects(t, pool))
	require.Equal(t, int32(1), runs.Load())
}

// TestRefusedConcurrently delivers one command from 32 goroutines at
// once, to a worker that remembers nothing, its handler refusing after a
// write: it runs once, one delivery records the failure, every other
// answers with it; no effect.
func TestRefusedConcurrently(t *testing.T) {
	t.Parallel()
	pool := effectsDB(t)
	var runs atomic.Int32
	def := saga.MustNew("refused", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			runs.Add(1)
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			return nil, saga.Permanent(errors.New("account closed"))
		},
	})
	w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	id := testenv.NewSaga(t, pool, "refused")
	replies := handleAtOnce(t, w, testenv.Command(id, "refused", "write", saga.PhaseForward, 1, 1), 32)
	fresh := 0
	for _, r := range replies {
		require.Equal(t, wire.OutcomeFailed, r.Outcome)
		require.Equal(t, "account closed", r.Error)
		if !r.Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one delivery recorded the failure")
	require.Equal(t, int32(1), runs.Load(), "the handler ran once")
	require.Zero(t, countEffects(t, pool))
	outcome, _, _ := inbox(t, pool, id, saga.StepKey(id, "write", saga.PhaseForward))
	require.Equal(t, "failed", outcome)
	requireNoOpenTransaction(t, pool)
}

// TestFailureOnABrokenConnectionIsRecordedOnAnother: a handler whose
// connection broke under it (its backend terminated) fails; its failure is
// recorded on another connection, after the broken one went back to the
// pool. With a pool of one connection, holding on to the broken one would
// leave the record waiting for a connection until its timeout.
func TestFailureOnABrokenConnectionIsRecordedOnAnother(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := effectsDB(t)
	pool := poolWith(t, shared, func(*pgxpool.Config) {}) // one connection
	def := saga.MustNew("broken", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			var pid int
			if err := sc.Tx.QueryRow(ctx, `select pg_backend_pid()`).Scan(&pid); err != nil {
				return nil, err
			}
			if _, err := shared.Exec(ctx, `select pg_terminate_backend($1, 5000)`, pid); err != nil {
				return nil, err
			}
			return nil, saga.Permanent(errors.New("the connection broke"))
		},
	})
	id := testenv.NewSaga(t, shared, "broken")
	reply, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "broken", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err) // not "record the failure: ... context deadline exceeded"
	require.Equal(t, wire.OutcomeFailed, reply.Outcome)
	require.Zero(t, countEffects(t, pool))
	outcome, _, _ := inbox(t, shared, id, reply.Key)
	require.Equal(t, "failed", outcome)
}

// TestHandlerThatEndsTheTx: a handler that ends the step's transaction
// itself and returns success fails for good, instead of having its
// success commit on its own. After a ROLLBACK, the failure is recorded and
// nothing of the effect stays; after a COMMIT, the effect and the claim
// stay, and the reply answers with the claim's success. Either way one
// reply, so the saga moves on.
func TestHandlerThatEndsTheTx(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		end     string
		effects int
		outcome wire.Outcome
		inbox   string
	}{
		{"rollback", 0, wire.OutcomeFailed, "failed"},
		{"commit", 1, wire.OutcomeSucceeded, "succeeded"},
	} {
		t.Run(tc.end, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			shared := effectsDB(t)
			pool := poolWith(t, shared, func(*pgxpool.Config) {})
			def := saga.MustNew("ends", saga.Step{
				Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if err := writeEffect(ctx, sc); err != nil {
						return nil, err
					}
					_, err := sc.Tx.Exec(ctx, tc.end)
					return nil, err
				},
			})
			id := testenv.NewSaga(t, shared, "ends")
			reply, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "ends", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, tc.outcome, reply.Outcome)
			if tc.outcome == wire.OutcomeFailed {
				require.Contains(t, reply.Error, "ended the step's transaction itself")
			}
			require.Equal(t, tc.effects, countEffects(t, pool))
			outcome, _, _ := inbox(t, shared, id, reply.Key)
			require.Equal(t, tc.inbox, outcome)
			var outbox int
			require.NoError(t, shared.QueryRow(ctx, `select count(*) from idemsaga.outbox`).Scan(&outbox))
			require.Equal(t, 1, outbox, "one reply")
			requireNoOpenTransaction(t, shared)
		})
	}
}

// TestHandlerTransaction checks the transaction a handler receives: every
// method writes in the step's transaction, which commits with the inbox
// row; a savepoint the handler makes rolls back alone; and the Tx is
// closed once the step is. It runs on pgx's extended protocol and on its
// simple protocol (a pooler in transaction mode, say).
func TestHandlerTransaction(t *testing.T) {
	t.Parallel()
	for _, simple := range []bool{false, true} {
		t.Run(fmt.Sprintf("simple protocol %v", simple), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			shared := testenv.DB(t)
			_, err := shared.Exec(ctx, `create table notes (id int primary key, body text not null)`)
			require.NoError(t, err)
			pool := poolWith(t, shared, func(cfg *pgxpool.Config) {
				cfg.MaxConns = 2
				if simple {
					cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				}
			})
			var kept saga.Tx
			def := saga.MustNew("notes", saga.Step{
				Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					kept = sc.Tx
					if _, err := sc.Tx.Exec(ctx, `insert into notes values (1, 'exec')`); err != nil {
						return nil, err
					}
					b := &pgx.Batch{}
					b.Queue(`insert into notes values (2, 'batch')`)
					if err := sc.Tx.SendBatch(ctx, b).Close(); err != nil {
						return nil, err
					}
					if _, err := sc.Tx.CopyFrom(ctx, pgx.Identifier{"notes"}, []string{"id", "body"}, pgx.CopyFromRows([][]any{{3, "copy"}})); err != nil {
						return nil, err
					}
					if _, err := sc.Tx.Exec(ctx, `savepoint mine`); err != nil {
						return nil, err
					}
					if _, err := sc.Tx.Exec(ctx, `insert into notes values (4, 'rolled back')`); err != nil {
						return nil, err
					}
					if _, err := sc.Tx.Exec(ctx, `rollback to savepoint mine`); err != nil {
						return nil, err
					}
					rows, err := sc.Tx.Query(ctx, `select id from notes order by id`)
					if err != nil {
						return nil, err
					}
					ids, err := pgx.CollectRows(rows, pgx.RowTo[int])
					if err != nil {
						return nil, err
					}
					return json.Marshal(ids)
				},
			})
			id := testenv.NewSaga(t, shared, "notes")
			reply, err := newWorker(t, pool, def).Handle(ctx, testenv.Command(id, "notes", "write", saga.PhaseForward, 1, struct{}{}))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			require.JSONEq(t, `[1,2,3]`, string(reply.Result), "the handler saw its own writes, without the rolled-back savepoint")

			rows, err := shared.Query(ctx, `select id from notes order by id`)
			require.NoError(t, err)
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int])
			require.NoError(t, err)
			require.Equal(t, []int{1, 2, 3}, ids)
			outcome, _, _ := inbox(t, shared, id, reply.Key)
			require.Equal(t, "succeeded", outcome, "the inbox record committed with the writes")

			_, err = kept.Exec(ctx, `insert into notes values (5, 'too late')`)
			require.ErrorIs(t, err, pgx.ErrTxClosed, "a Tx kept past its step is closed")
			require.ErrorIs(t, kept.QueryRow(ctx, `select 1`).Scan(new(int)), pgx.ErrTxClosed)
			requireNoOpenTransaction(t, shared)
		})
	}
}
