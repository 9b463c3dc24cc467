package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestTxOnlyClaimTravelsWithTheFirstStatement runs TxOnly steps whose
// handlers begin in every way a handler can: a statement that can share the
// claim's round trip, one that cannot (a query, a statement without
// arguments), no statement at all, and one that ignores the duplicate
// error. Each runs once with effect; delivered again to another worker (no
// remembered answer), it is answered from the inbox, its first statement
// fails with ErrDuplicateDelivery, and nothing it wrote survives.
func TestTxOnlyClaimTravelsWithTheFirstStatement(t *testing.T) {
	t.Parallel()
	insert := writeEffect
	for _, tc := range []struct {
		name string
		// first is the handler's opening; its error is the first
		// statement's.
		first func(ctx context.Context, sc *saga.StepContext) error
		// effects is how many rows one run writes.
		effects int
		// ignoreDuplicate makes the handler return success whatever its
		// statements answered.
		ignoreDuplicate bool
	}{
		{name: "exec with arguments", first: insert, effects: 1},
		{name: "query first", first: func(ctx context.Context, sc *saga.StepContext) error {
			var n int
			if err := sc.Tx.QueryRow(ctx, `select count(*) from effects where saga_id = $1`, sc.SagaID).Scan(&n); err != nil {
				return err
			}
			return insert(ctx, sc)
		}, effects: 1},
		{name: "exec without arguments", first: func(ctx context.Context, sc *saga.StepContext) error {
			if _, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values (gen_random_uuid(), 'no-args')`); err != nil {
				return err
			}
			return insert(ctx, sc)
		}, effects: 2},
		{name: "no statement", first: func(context.Context, *saga.StepContext) error { return nil }, effects: 0},
		{name: "duplicate ignored", first: insert, effects: 1, ignoreDuplicate: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := effectsDB(t)
			var runs atomic.Int32
			var firstErrs []error
			def := saga.MustNew("txonly", saga.Step{
				Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					runs.Add(1)
					err := tc.first(ctx, sc)
					firstErrs = append(firstErrs, err)
					if err != nil && !tc.ignoreDuplicate {
						return nil, fmt.Errorf("write: %w", err)
					}
					return json.RawMessage(`{"ok":true}`), nil
				},
			})
			id := uuid.New()
			cmd := command(id, "txonly", "write", saga.PhaseForward, 1, map[string]int{"n": 1})

			reply, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.False(t, reply.Duplicate)
			require.JSONEq(t, `{"ok":true}`, string(reply.Result))
			require.NoError(t, firstErrs[0])
			require.Equal(t, tc.effects, countEffects(t, pool))

			again, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.True(t, again.Duplicate, "the inbox answers")
			require.JSONEq(t, `{"ok":true}`, string(again.Result))
			require.Equal(t, tc.effects, countEffects(t, pool), "the duplicate's writes are rolled back")
			require.Equal(t, int32(2), runs.Load(), "a TxOnly handler runs up to its first statement")
			if tc.effects > 0 {
				require.ErrorIs(t, firstErrs[1], saga.ErrDuplicateDelivery)
			}
			var inbox, replies int
			require.NoError(t, pool.QueryRow(ctx, `select
  (select count(*) from idemsaga.inbox where saga_id = $1),
  (select count(*) from idemsaga.outbox where saga_id = $1)`, id).Scan(&inbox, &replies))
			require.Equal(t, []int{1, 1}, []int{inbox, replies}, "one inbox row, one reply")
		})
	}
}

// TestTxOnlyAnotherAttemptIsAnsweredWithAReply: a delivery of another
// attempt of a TxOnly step that already took effect rolls back what its
// first statement did, then answers that attempt with a reply in a
// transaction of its own.
func TestTxOnlyAnotherAttemptIsAnsweredWithAReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := effectsDB(t)
	def := saga.MustNew("txonly", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			return nil, writeEffect(ctx, sc)
		},
	})
	id := uuid.New()
	_, err := newWorker(t, pool, def).Handle(ctx, command(id, "txonly", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	reply, err := newWorker(t, pool, def).Handle(ctx, command(id, "txonly", "write", saga.PhaseForward, 2, 1))
	require.NoError(t, err)
	require.True(t, reply.Duplicate)
	require.Equal(t, 2, reply.Attempt)
	require.Equal(t, 1, countEffects(t, pool))
	var replies int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where saga_id = $1`, id).Scan(&replies))
	require.Equal(t, 2, replies, "attempt 1's reply and attempt 2's")
}

func countEffects(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from effects`).Scan(&n))
	return n
}

// withoutTxOnly returns def with every step's claim sent before its
// handler.
func withoutTxOnly(t *testing.T, def *saga.Definition) *saga.Definition {
	t.Helper()
	all := def.Steps()
	for i := range all {
		all[i].TxOnly = false
	}
	d, err := saga.New(def.Name(), all...)
	require.NoError(t, err)
	return d
}

// TestTxOnlyDuplicateKeepsTheHandlersStatementPrepared: a duplicate's claim
// fails by design before the handler's first statement runs, and that
// statement stays prepared on the connection (pgx would otherwise drop it
// with the failed batch and prepare it again, two round trips more per
// duplicate).
func TestTxOnlyDuplicateKeepsTheHandlersStatementPrepared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := poolWith(t, effectsDB(t), func(*pgxpool.Config) {})

	const insert = `insert into effects (saga_id, step) values ($1, $2)`
	def := saga.MustNew("txonly", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			_, err := sc.Tx.Exec(ctx, insert, sc.SagaID, sc.Step)
			return nil, err
		},
	})
	cmd := command(uuid.New(), "txonly", "write", saga.PhaseForward, 1, 1)
	prepared := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from pg_prepared_statements where statement = $1`, insert).Scan(&n))
		return n
	}
	_, err := newWorker(t, pool, def).Handle(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, 1, prepared())
	reply, err := newWorker(t, pool, def).Handle(ctx, cmd)
	require.NoError(t, err)
	require.True(t, reply.Duplicate)
	require.Equal(t, 1, prepared(), "the handler's statement is still prepared")
	require.Equal(t, 1, countEffects(t, pool))
}

// writeEffect is a handler's business write: a row in effects.
func writeEffect(ctx context.Context, sc *saga.StepContext) error {
	_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, $2)`, sc.SagaID, sc.Step)
	return err
}

// tracedEffectsDB returns a pool of one connection to a fresh effectsDB,
// and what counts its round trips.
func tracedEffectsDB(t *testing.T) (*pgxpool.Pool, *testenv.RoundTrips) {
	t.Helper()
	trips := &testenv.RoundTrips{}
	return poolWith(t, effectsDB(t), func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = trips }), trips
}

// requireNoOpenTransaction fails the test if a session on pool's database
// sits idle inside a transaction.
func requireNoOpenTransaction(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var idle int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from pg_stat_activity where datname = current_database() and state like 'idle in transaction%'`).Scan(&idle))
	require.Zero(t, idle, "no transaction left open")
}

// poolWith returns a pool of one connection to shared's database, set by
// change.
func poolWith(t testing.TB, shared *pgxpool.Pool, change func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg := shared.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	change(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestTxOnlySavesARoundTrip counts what a step sends once its connection
// is warm: a TxOnly step whose handler makes one statement sends two
// batches (the claim with the statement, then the outcome with COMMIT);
// the same step without TxOnly sends the statement on its own in between.
func TestTxOnlySavesARoundTrip(t *testing.T) {
	t.Parallel()
	for _, txOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("TxOnly %v", txOnly), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			def := saga.MustNew("txonly", saga.Step{
				Name: "write", Reaches: "written", TxOnly: txOnly,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					return nil, writeEffect(ctx, sc)
				},
			})
			w := newWorker(t, pool, def)
			_, err := w.Handle(ctx, command(uuid.New(), "txonly", "write", saga.PhaseForward, 1, 1)) // warms the connection
			require.NoError(t, err)
			trips.Reset()
			_, err = w.Handle(ctx, command(uuid.New(), "txonly", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			want := []int32{2, 1}
			if txOnly {
				want = []int32{2, 0}
			}
			require.Equal(t, want, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
			require.Equal(t, 2, countEffects(t, pool))
		})
	}
}

// TestTxOnlyEdgeCases: a handler that takes the connection first, one
// whose first statement fails before it is sent (pgx prepares a batch
// first), and a pool on pgx's simple protocol. Each runs once with effect,
// is answered from the inbox when delivered again, and a statement error
// stays the handler's.
func TestTxOnlyEdgeCases(t *testing.T) {
	t.Parallel()
	insert := `insert into effects (saga_id, step) values ($1, $2)`
	for _, tc := range []struct {
		name    string
		simple  bool
		forward saga.HandlerFunc
		// effects is what one run leaves; outcome is the first reply's.
		effects int
		outcome wire.Outcome
	}{
		{name: "connection first", effects: 1, outcome: wire.OutcomeSucceeded,
			forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				_, err := sc.Tx.Conn().Exec(ctx, insert, sc.SagaID, sc.Step)
				return nil, err
			}},
		{name: "first statement fails to prepare", effects: 0, outcome: wire.OutcomeFailed,
			forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, no_such_column) values ($1, $2)`, sc.SagaID, sc.Step)
				return nil, saga.Permanent(err)
			}},
		{name: "simple protocol", simple: true, effects: 1, outcome: wire.OutcomeSucceeded,
			forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				_, err := sc.Tx.Exec(ctx, insert, sc.SagaID, sc.Step)
				return nil, err
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			shared := effectsDB(t)
			pool := poolWith(t, shared, func(cfg *pgxpool.Config) {
				if tc.simple {
					cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				}
			})
			def := saga.MustNew("txonly", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: tc.forward})
			cmd := command(uuid.New(), "txonly", "write", saga.PhaseForward, 1, 1)

			first, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.False(t, first.Duplicate)
			require.Equal(t, tc.outcome, first.Outcome)
			if tc.outcome == wire.OutcomeFailed {
				require.Contains(t, first.Error, "no_such_column", "the statement's error is the handler's")
			}
			require.Equal(t, tc.effects, countEffects(t, pool))

			again, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.True(t, again.Duplicate)
			require.Equal(t, tc.outcome, again.Outcome)
			require.Equal(t, tc.effects, countEffects(t, pool), "the duplicate took no effect")
			requireNoOpenTransaction(t, pool)
		})
	}
}

// effectsDB returns a test database with a table for handlers' effects.
func effectsDB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := testenv.DB(t)
	_, err := pool.Exec(context.Background(), `create table effects (saga_id uuid not null, step text not null)`)
	require.NoError(t, err)
	return pool
}

// TestDuplicateThatWaitedOnTheClaim: a second delivery that reaches the
// inbox while the first still holds the key waits on it, and when the
// first commits, answers with what it committed, although its claim's
// statement began before that commit: the claim's ON CONFLICT DO UPDATE
// hands idemsaga.key_held the row it met, in its latest committed version,
// with the result recorded after the claim. (A result kept in the step's
// row, read by key_held with a snapshot of its own, is the engine's
// TestDuplicateWaitingOnAGuessedSuccess.)
func TestDuplicateThatWaitedOnTheClaim(t *testing.T) {
	t.Parallel()
	for _, txOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("TxOnly %v", txOnly), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := effectsDB(t)
			holding, release := make(chan struct{}), make(chan struct{})
			var runs atomic.Int32
			def := saga.MustNew("waited", saga.Step{
				Name: "write", Reaches: "written", TxOnly: txOnly,
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
			cmd := command(uuid.New(), "waited", "write", saga.PhaseForward, 1, 1)

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
		})
	}
}

// TestFailureRollsBackOnlyAnOpenTransaction: a TxOnly handler that fails
// before any statement never sent its claim, so no transaction is open and
// no ROLLBACK goes out (PostgreSQL would answer it with a warning in its
// log); one that failed after its statement rolls back as ever. Either way
// the permanent failure is recorded and nothing the handler wrote stays.
func TestFailureRollsBackOnlyAnOpenTransaction(t *testing.T) {
	t.Parallel()
	for _, wrote := range []bool{false, true} {
		t.Run(fmt.Sprintf("failed after a statement %v", wrote), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			def := saga.MustNew("fails", saga.Step{
				Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if wrote {
						if err := writeEffect(ctx, sc); err != nil {
							return nil, err
						}
					}
					return nil, saga.Permanent(errors.New("account closed"))
				},
			})
			w := newWorker(t, pool, def)
			_, err := w.Handle(ctx, command(uuid.New(), "fails", "write", saga.PhaseForward, 1, 1)) // warms the connection
			require.NoError(t, err)
			trips.Reset()
			reply, err := w.Handle(ctx, command(uuid.New(), "fails", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeFailed, reply.Outcome)
			require.Equal(t, "account closed", reply.Error)
			require.Equal(t, wrote, slices.Contains(trips.SentAlone(), "rollback"), "statements sent alone: %q", trips.SentAlone())
			require.Zero(t, countEffects(t, pool))
		})
	}
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
		Name: "write", Reaches: "written",
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			if _, err := shared.Exec(ctx, `select pg_terminate_backend($1, 5000)`, sc.Tx.Conn().PgConn().PID()); err != nil {
				return nil, err
			}
			return nil, saga.Permanent(errors.New("the connection broke"))
		},
	})
	reply, err := newWorker(t, pool, def).Handle(ctx, command(uuid.New(), "broken", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err) // not "begin failure record: ... context deadline exceeded"
	require.Equal(t, wire.OutcomeFailed, reply.Outcome)
	require.Zero(t, countEffects(t, pool))
	var outcome string
	require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where step_key = $1`, pguuid.Of(reply.Key)).Scan(&outcome))
	require.Equal(t, "failed", outcome)
}

// TestFailureOnAConnectionBrokenWhileIdle: a TxOnly handler fails before
// its first statement, so its held-back claim never went out, while the
// connection's backend was terminated. The connection still reads as idle
// (no ROLLBACK is due); the failure record's BEGIN finds the break, and
// the record is made on another connection of the one-connection pool.
func TestFailureOnAConnectionBrokenWhileIdle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := effectsDB(t)
	app := "idle-broken-" + uuid.NewString()[:8]
	pool := poolWith(t, shared, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["application_name"] = app })
	def := saga.MustNew("idlebroken", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			var n int
			if err := shared.QueryRow(ctx, `select count(pg_terminate_backend(pid, 5000)) from pg_stat_activity where application_name = $1`, app).Scan(&n); err != nil {
				return nil, err
			}
			if n != 1 {
				return nil, fmt.Errorf("terminated %d backends, want the worker's one", n)
			}
			return nil, saga.Permanent(errors.New("account closed"))
		},
	})
	reply, err := newWorker(t, pool, def).Handle(ctx, command(uuid.New(), "idlebroken", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err) // not "begin failure record: FATAL: terminating connection"
	require.Equal(t, wire.OutcomeFailed, reply.Outcome)
	var outcome string
	require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where step_key = $1`, pguuid.Of(reply.Key)).Scan(&outcome))
	require.Equal(t, "failed", outcome)
}

// TestDuplicateCostsOneRoundTrip: a delivery whose key the inbox holds
// already is answered from the claim's own round trip, whatever the outcome
// it finds: the claim raises with the stored outcome. A redelivery
// (HandleRedelivered) is answered by a plain read of the inbox instead,
// without the claim or its raise. Delivered to a worker that does not
// remember it, on a warm connection.
func TestDuplicateCostsOneRoundTrip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		result json.RawMessage
		err    error
		want   wire.Reply
	}{
		{name: "a success", result: json.RawMessage(`{"took":[1,"two"]}`),
			want: wire.Reply{Outcome: wire.OutcomeSucceeded, Result: json.RawMessage(`{"took":[1,"two"]}`)}},
		{name: "a success without result", want: wire.Reply{Outcome: wire.OutcomeSucceeded}},
		{name: "a permanent failure", err: saga.Permanent(errors.New(`card "declined"`)),
			want: wire.Reply{Outcome: wire.OutcomeFailed, Error: `card "declined"`}},
	} {
		for _, v := range []struct{ txOnly, redelivered bool }{{true, false}, {false, false}, {true, true}, {false, true}} {
			txOnly := v.txOnly
			t.Run(fmt.Sprintf("%s TxOnly %v redelivered %v", tc.name, txOnly, v.redelivered), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pool, trips := tracedEffectsDB(t)
				def := saga.MustNew("dup", saga.Step{
					Name: "write", Reaches: "written", TxOnly: txOnly,
					Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
						if err := writeEffect(ctx, sc); err != nil {
							return nil, err
						}
						return tc.result, tc.err
					},
				})
				cmd := command(uuid.New(), "dup", "write", saga.PhaseForward, 1, 1)
				_, err := newWorker(t, pool, def).Handle(ctx, cmd)
				require.NoError(t, err)
				again := newWorker(t, pool, def)
				_, err = again.Handle(ctx, command(uuid.New(), "dup", "write", saga.PhaseForward, 1, 1)) // warms its statements
				require.NoError(t, err)

				if v.redelivered {
					// and the read's
					_, err = again.HandleRedelivered(ctx, command(uuid.New(), "dup", "write", saga.PhaseForward, 1, 1))
					require.NoError(t, err)
				}

				trips.Reset()
				var reply wire.Reply
				if v.redelivered {
					reply, err = again.HandleRedelivered(ctx, cmd)
					require.NoError(t, err)
					require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
					require.Contains(t, trips.SentAlone()[0], "select i.outcome", "the inbox is read, not claimed")
				} else {
					reply, err = again.Handle(ctx, cmd)
					require.NoError(t, err)
					require.Equal(t, []int32{1, 0}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
				}
				require.True(t, reply.Duplicate)
				require.Equal(t, tc.want.Outcome, reply.Outcome)
				require.Equal(t, tc.want.Error, reply.Error)
				if tc.want.Result == nil {
					require.Empty(t, reply.Result)
				} else {
					require.JSONEq(t, string(tc.want.Result), string(reply.Result))
				}
				want := 2
				if v.redelivered {
					want = 3
				}
				if tc.err != nil {
					want = 0
				}
				require.Equal(t, want, countEffects(t, pool))
			})
		}
	}
}

// TestRedeliveryOfAnAttemptNotCommitted: a redelivery that finds nothing in
// the inbox (the first delivery failed, or its process died before the
// commit) runs the attempt as any delivery does, one round trip later (the
// read), and takes effect once.
func TestRedeliveryOfAnAttemptNotCommitted(t *testing.T) {
	t.Parallel()
	for _, txOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("TxOnly %v", txOnly), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			var calls atomic.Int32
			def := saga.MustNew("again", saga.Step{
				Name: "write", Reaches: "written", TxOnly: txOnly,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if err := writeEffect(ctx, sc); err != nil {
						return nil, err
					}
					if calls.Add(1) == 2 {
						return nil, errors.New("the first delivery of the measured command fails")
					}
					return json.RawMessage(`{"n":1}`), nil
				},
			})
			w := newWorker(t, pool, def)
			_, err := w.HandleRedelivered(ctx, command(uuid.New(), "again", "write", saga.PhaseForward, 1, 1)) // warms the statements
			require.NoError(t, err)
			cmd := command(uuid.New(), "again", "write", saga.PhaseForward, 1, 1)
			reply, err := w.Handle(ctx, cmd)
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeRetry, reply.Outcome, "the first delivery failed and committed nothing of the step")

			trips.Reset()
			reply, err = w.HandleRedelivered(ctx, cmd)
			require.NoError(t, err)
			require.False(t, reply.Duplicate)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			require.JSONEq(t, `{"n":1}`, string(reply.Result))
			batches, alone := int32(2), int32(1) // the claim with the statement, then COMMIT; the read
			if !txOnly {
				batches, alone = 2, 2 // the claim, then COMMIT; the read and the statement
			}
			require.Equal(t, []int32{batches, alone}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
			require.Contains(t, trips.SentAlone()[0], "select i.outcome")
			var n int
			require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects where saga_id = $1`, cmd.SagaID).Scan(&n))
			require.Equal(t, 1, n, "one effect")
		})
	}
}
