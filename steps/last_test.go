package steps_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

const insertEffect = `insert into effects (saga_id, step) values ($1, $2)`

// meteredWorker returns a worker for def on pool with metrics of its own,
// its Config set by change.
func meteredWorker(t testing.TB, pool *pgxpool.Pool, def *saga.Definition, change func(*steps.Config)) (*steps.Worker, *metrics.Metrics) {
	t.Helper()
	m, err := metrics.New(prometheus.NewRegistry())
	require.NoError(t, err)
	cfg := steps.Config{
		Pool: pool, Subjects: wire.Subjects{Prefix: "t"}, Definitions: []*saga.Definition{def},
		Metrics: m, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	change(&cfg)
	w, err := steps.New(cfg)
	require.NoError(t, err)
	return w, m
}

// handleAtOnce delivers cmd to w from n goroutines released together, and
// returns their replies, each without error.
func handleAtOnce(t *testing.T, w *steps.Worker, cmd wire.Command, n int) []wire.Reply {
	t.Helper()
	replies := make([]wire.Reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			replies[i], errs[i] = w.Handle(context.Background(), cmd)
		})
	}
	close(gate)
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	return replies
}

// lastEffect is a handler whose business write goes by ExecLast, after
// `before` other writes.
func lastEffect(before int) saga.HandlerFunc {
	return func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		for range before {
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
		}
		return nil, sc.ExecLast(ctx, insertEffect, sc.SagaID, sc.Step)
	}
}

// TestExecLastTravelsWithTheSuccess counts what a warm step sends: a
// TxOnly step whose one statement goes by ExecLast is one batch (claim,
// statement, outcome, COMMIT); with a write before it, two (that write
// carries the claim). Without TxOnly the statement runs at once, as Exec.
func TestExecLastTravelsWithTheSuccess(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		txOnly        bool
		before        int
		batches, lone int32
	}{
		{true, 0, 1, 0},
		{true, 1, 2, 0},
		{false, 0, 2, 1},
	} {
		t.Run(fmt.Sprintf("TxOnly %v, %d before", tc.txOnly, tc.before), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: tc.txOnly, Forward: lastEffect(tc.before)})
			w := newWorker(t, pool, def)
			_, err := w.Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)) // warms the connection
			require.NoError(t, err)
			trips.Reset()
			reply, err := w.Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			require.Equal(t, []int32{tc.batches, tc.lone}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
			require.Equal(t, 2*(tc.before+1), countEffects(t, pool))

			// The same command again: the claim the statement carries
			// finds the key taken, in one round trip, and nothing runs.
			trips.Reset()
			again, err := newWorker(t, pool, def).Handle(ctx, command(reply.SagaID, "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.True(t, again.Duplicate)
			require.Equal(t, wire.OutcomeSucceeded, again.Outcome)
			require.Equal(t, []int32{1, 0}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "one round trip for the duplicate")
			require.Equal(t, 2*(tc.before+1), countEffects(t, pool), "the duplicate took no effect")
		})
	}
}

// TestExecLastFailureRunsTheHandlerAgain: a held-back last statement that
// fails undoes the whole attempt, its claim and the writes before it
// included; the handler runs again, gets the statement's error from
// ExecLast, and its verdict is recorded as any other: a permanent failure
// in the inbox, a retry for a transient one. Also on a pool on pgx's
// simple protocol, which sends a batch as one string of statements.
func TestExecLastFailureRunsTheHandlerAgain(t *testing.T) {
	t.Parallel()
	for _, v := range []struct{ permanent, simple bool }{{true, false}, {false, false}, {true, true}} {
		permanent := v.permanent
		t.Run(fmt.Sprintf("permanent %v simple protocol %v", permanent, v.simple), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := poolWith(t, effectsDB(t), func(cfg *pgxpool.Config) {
				if v.simple {
					cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
				}
			})
			var runs atomic.Int32
			var seen []error
			def := saga.MustNew("last", saga.Step{
				Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					runs.Add(1)
					if err := writeEffect(ctx, sc); err != nil {
						return nil, err
					}
					err := sc.ExecLast(ctx, `select 1 / $1::int`, 0)
					seen = append(seen, err)
					if err != nil && permanent {
						return nil, saga.Permanent(err)
					}
					return nil, err
				},
			})
			w, m := meteredWorker(t, pool, def, func(*steps.Config) {})
			id := uuid.New()
			reply, err := w.Handle(ctx, command(id, "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)

			require.Equal(t, int32(2), runs.Load(), "the handler ran again")
			require.Len(t, seen, 2)
			require.NoError(t, seen[0], "held back: no error yet")
			var pgErr *pgconn.PgError
			require.ErrorAs(t, seen[1], &pgErr, "run at once: the statement's error")
			require.Equal(t, "22012", pgErr.Code)
			require.Equal(t, 1.0, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
			require.Zero(t, countEffects(t, pool), "nothing of either run committed")

			var outcome string
			err = pool.QueryRow(ctx, `select outcome from idemsaga.inbox where saga_id = $1`, id).Scan(&outcome)
			if permanent {
				require.Equal(t, wire.OutcomeFailed, reply.Outcome)
				require.Contains(t, reply.Error, "division by zero")
				require.NoError(t, err)
				require.Equal(t, "failed", outcome)
			} else {
				require.Equal(t, wire.OutcomeRetry, reply.Outcome)
				require.Error(t, err, "a retry leaves the key free")
			}
			requireNoOpenTransaction(t, pool)
		})
	}
}

// TestTxAfterExecLastFails: ExecLast must be a handler's last use of its
// transaction. A use after it fails, whether the statement was held back
// or ran at once, and says so; nothing of the attempt commits.
func TestTxAfterExecLastFails(t *testing.T) {
	t.Parallel()
	for _, txOnly := range []bool{true, false} {
		t.Run(fmt.Sprintf("TxOnly %v", txOnly), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := poolWith(t, effectsDB(t), func(*pgxpool.Config) {})
			var after error
			def := saga.MustNew("last", saga.Step{
				Name: "write", Reaches: "written", TxOnly: txOnly,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if err := sc.ExecLast(ctx, insertEffect, sc.SagaID, sc.Step); err != nil {
						return nil, err
					}
					after = writeEffect(ctx, sc)
					return nil, after
				},
			})
			reply, err := newWorker(t, pool, def).Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.ErrorContains(t, after, "after StepContext.ExecLast, which must be its last statement")
			require.True(t, saga.IsPermanent(after), "the same on every attempt")
			require.Equal(t, wire.OutcomeFailed, reply.Outcome)
			require.Zero(t, countEffects(t, pool))
		})
	}
}

// TestExecLastSameCommandConcurrently delivers one command from 32
// goroutines at once to workers that remember nothing, its handler a write
// before a held-back last statement: one delivery runs it, every other
// answers with its outcome, and the effects are there once.
func TestExecLastSameCommandConcurrently(t *testing.T) {
	t.Parallel()
	pool := effectsDB(t)
	def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: lastEffect(1)})
	w, _ := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	cmd := command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)

	replies := handleAtOnce(t, w, cmd, 32)
	fresh := 0
	for i := range replies {
		require.Equal(t, wire.OutcomeSucceeded, replies[i].Outcome)
		if !replies[i].Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one delivery ran the handler")
	require.Equal(t, 2, countEffects(t, pool), "both writes, once")
}

// TestExecLastWithAnApplyFuncThatSendsNothing: Apply.Pending holds the
// held-back statement and the claim. An ApplyFunc that returns no writes
// gets them sent by the worker, with the step's commit, in one batch; one
// that returns writes of its own without them has the attempt run again
// with the statement at once. Either way the effect commits once, with
// its inbox row.
func TestExecLastWithAnApplyFuncThatSendsNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		writes func(a steps.Apply) *pgx.Batch
		reruns float64
	}{
		{"no writes", func(steps.Apply) *pgx.Batch { return nil }, 0},
		{"writes without Pending", func(steps.Apply) *pgx.Batch { return &pgx.Batch{} }, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := poolWith(t, effectsDB(t), func(*pgxpool.Config) {})
			def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: lastEffect(0)})
			w, m := meteredWorker(t, pool, def, func(cfg *steps.Config) {
				cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
					return steps.Applied{Writes: tc.writes(a)}, nil
				}
			})
			id := uuid.New()
			reply, err := w.Handle(ctx, command(id, "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			require.Equal(t, 1, countEffects(t, pool))
			var outcome string
			require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where saga_id = $1`, id).Scan(&outcome))
			require.Equal(t, "succeeded", outcome)
			require.Equal(t, tc.reruns, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
		})
	}
}

// TestHandlerThatEndsTheTx: a handler that ends the step's transaction
// through the connection and returns success fails for good, instead of
// having its success commit on its own. After a ROLLBACK, the failure is
// recorded and nothing of the effect stays; after a COMMIT, the effect and
// the claim stay, and the reply answers with the claim's success. Either
// way one reply, so the saga moves on.
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
		for _, txOnly := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s TxOnly %v", tc.end, txOnly), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pool := poolWith(t, effectsDB(t), func(*pgxpool.Config) {})
				def := saga.MustNew("ends", saga.Step{
					Name: "write", Reaches: "written", TxOnly: txOnly,
					Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
						if err := writeEffect(ctx, sc); err != nil {
							return nil, err
						}
						_, err := sc.Tx.Conn().Exec(ctx, tc.end)
						return nil, err
					},
				})
				id := uuid.New()
				reply, err := newWorker(t, pool, def).Handle(ctx, command(id, "ends", "write", saga.PhaseForward, 1, 1))
				require.NoError(t, err)
				require.Equal(t, tc.outcome, reply.Outcome)
				if tc.outcome == wire.OutcomeFailed {
					require.Contains(t, reply.Error, "after ending the step's transaction")
				}
				require.Equal(t, tc.effects, countEffects(t, pool))
				var inbox string
				var outbox int
				require.NoError(t, pool.QueryRow(ctx, `select (select outcome from idemsaga.inbox), (select count(*) from idemsaga.outbox)`).Scan(&inbox, &outbox))
				require.Equal(t, tc.inbox, inbox)
				require.Equal(t, 1, outbox, "one reply")
			})
		}
	}
}

// TestExecLastRedelivered: a redelivery of an attempt that committed is
// answered by the inbox read, without running the handler; one of an
// attempt that never committed takes the held-back path, once.
func TestExecLastRedelivered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, trips := tracedEffectsDB(t)
	var runs atomic.Int32
	def := saga.MustNew("last", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			runs.Add(1)
			return lastEffect(0)(ctx, sc)
		},
	})
	cmd := command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)
	_, err := newWorker(t, pool, def).Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)) // warms the connection
	require.NoError(t, err)
	trips.Reset()
	first, err := newWorker(t, pool, def).HandleRedelivered(ctx, cmd)
	require.NoError(t, err)
	require.False(t, first.Duplicate)
	require.Equal(t, []int32{1, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "the read, then the held-back batch")
	require.Equal(t, int32(2), runs.Load())

	trips.Reset()
	again, err := newWorker(t, pool, def).HandleRedelivered(ctx, cmd)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, wire.OutcomeSucceeded, again.Outcome)
	require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "the read alone")
	require.Equal(t, int32(2), runs.Load(), "the handler did not run again")
	require.Equal(t, 2, countEffects(t, pool))
}

// TestExecLastRefusedConcurrently delivers one command from 32 goroutines
// at once, its last statement failing every time: each delivery that
// claims runs its handler again and records the permanent failure, and
// only one can; every other answers with that failure. One inbox row,
// no effect.
func TestExecLastRefusedConcurrently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := effectsDB(t)
	def := saga.MustNew("last", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if err := writeEffect(ctx, sc); err != nil {
				return nil, err
			}
			if err := sc.ExecLast(ctx, `select 1 / $1::int`, 0); err != nil {
				return nil, saga.Permanent(err)
			}
			return nil, nil
		},
	})
	w, m := meteredWorker(t, pool, def, func(cfg *steps.Config) { cfg.Recent = -1 })
	id := uuid.New()
	cmd := command(id, "last", "write", saga.PhaseForward, 1, 1)

	replies := handleAtOnce(t, w, cmd, 32)
	fresh := 0
	for i := range replies {
		require.Equal(t, wire.OutcomeFailed, replies[i].Outcome)
		require.Contains(t, replies[i].Error, "division by zero")
		if !replies[i].Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one delivery recorded the failure")
	require.GreaterOrEqual(t, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")), 1.0, "the held-back path ran")
	require.Zero(t, countEffects(t, pool))
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.inbox where saga_id = $1 and outcome = 'failed'`, id).Scan(&rows))
	require.Equal(t, 1, rows)
}

// TestOneTripStepLeavesOutTheIdleBoundAndTheSavepoint reads what a TxOnly
// step sends. When its claim travels with its held-back last statement,
// the whole transaction is one batch, PostgreSQL's implicit transaction up
// to the batch's Sync: no BEGIN or COMMIT, no idle bound on the claim
// (PostgreSQL arms it only at a Sync), and with an ApplyFunc no savepoint.
// When a write went before, that write carries the claim and BEGIN, and
// the bound with them (the transaction then sits between two round
// trips), and the last batch has the savepoint (with an ApplyFunc) and
// ends with COMMIT.
func TestOneTripStepLeavesOutTheIdleBoundAndTheSavepoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		before int
		apply  bool
		bound  bool
	}{
		{0, false, false},
		{0, true, false},
		{1, false, true},
		{1, true, true},
	} {
		t.Run(fmt.Sprintf("%d before, ApplyFunc %v", tc.before, tc.apply), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: lastEffect(tc.before)})
			w, m := meteredWorker(t, pool, def, func(cfg *steps.Config) {
				cfg.Pool = pool
				if tc.apply {
					cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
						a.Pending.Queue(`insert into effects (saga_id, step) values ($1, 'applied')`, a.Command.SagaID)
						return steps.Applied{Writes: a.Pending}, nil
					}
				}
			})
			reply, err := w.Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1))
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			want := tc.before + 1
			if tc.apply {
				want++
			}
			require.Equal(t, want, countEffects(t, pool))
			require.Zero(t, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
			var outcome string
			require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where saga_id = $1`, reply.SagaID).Scan(&outcome))
			require.Equal(t, "succeeded", outcome, "the claim committed")
			require.Equal(t, int32(tc.before+1), trips.Batches.Load(), "round trips")

			sent := trips.SentInBatches()
			bound, savepoint, begin, commit := false, false, false, false
			for _, sql := range sent {
				bound = bound || strings.Contains(sql, "idle_in_transaction_session_timeout")
				savepoint = savepoint || strings.HasPrefix(sql, "savepoint")
				begin = begin || sql == "begin"
				commit = commit || sql == "commit"
			}
			require.True(t, strings.HasPrefix(sent[0], "insert into idemsaga.inbox"), "the claim first in %q", sent)
			require.Equal(t, tc.bound, bound, "idle bound in %q", sent)
			require.Equal(t, tc.bound && tc.apply, savepoint, "savepoint in %q", sent)
			require.Equal(t, []bool{tc.bound, tc.bound}, []bool{begin, commit}, "BEGIN and COMMIT in %q", sent)
			if tc.bound {
				require.Equal(t, "commit", sent[len(sent)-1])
			}
		})
	}
}

// TestOneTripApplyFailureRunsTheAttemptAgain: after a held-back last
// statement there is no savepoint, so a success that cannot be applied as
// the command foresaw fails the whole round trip. Nothing of it commits;
// the handler runs again with its statement at once, and the success is
// then applied after a savepoint, read rather than guessed again. The effect is
// there once, also when 16 deliveries of the command race.
func TestOneTripApplyFailureRunsTheAttemptAgain(t *testing.T) {
	t.Parallel()
	for _, deliveries := range []int{1, 16} {
		t.Run(fmt.Sprintf("%d deliveries", deliveries), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := effectsDB(t)
			var runs atomic.Int32
			var mu sync.Mutex
			var calls []string
			def := saga.MustNew("last", saga.Step{
				Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					runs.Add(1)
					return lastEffect(0)(ctx, sc)
				},
			})
			w, m := meteredWorker(t, pool, def, func(cfg *steps.Config) {
				cfg.Recent = -1
				cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
					mu.Lock()
					calls = append(calls, fmt.Sprintf("guess %v", a.Guess))
					mu.Unlock()
					if a.Guess {
						// As a saga that moved since the command was written.
						a.Pending.Queue(`select idemsaga.expect(false, 'saga at the version of the command')`)
						return steps.Applied{Writes: a.Pending, Guessed: true}, nil
					}
					a.Pending.Queue(`insert into effects (saga_id, step) values ($1, 'applied')`, a.Command.SagaID)
					return steps.Applied{Writes: a.Pending}, nil
				}
			})
			cmd := command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)
			replies := handleAtOnce(t, w, cmd, deliveries)
			fresh := 0
			for _, r := range replies {
				require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
				if !r.Duplicate {
					fresh++
				}
			}
			require.Equal(t, 1, fresh, "one delivery ran the attempt")
			require.Equal(t, 2, countEffects(t, pool), "the handler's effect and the applied success, once each")
			var outcome string
			require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where saga_id = $1`, cmd.SagaID).Scan(&outcome))
			require.Equal(t, "succeeded", outcome)
			if deliveries == 1 {
				require.Equal(t, 1.0, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
				require.Equal(t, int32(2), runs.Load(), "the handler ran twice")
				require.Equal(t, []string{"guess true", "guess false"}, calls,
					"guessed in the one round trip, then read after the savepoint")
			}
		})
	}
}

// TestOneTripCommitFailure: a step sent in one batch commits at the
// batch's Sync, without COMMIT. A failure there (here a deferred unique
// constraint) is the batch's error: nothing of the attempt commits, the
// delivery fails and is to be delivered again, as after a failed COMMIT,
// and no transaction stays open. With and without an ApplyFunc.
func TestOneTripCommitFailure(t *testing.T) {
	t.Parallel()
	for _, apply := range []bool{false, true} {
		t.Run(fmt.Sprintf("ApplyFunc %v", apply), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, trips := tracedEffectsDB(t)
			_, err := pool.Exec(ctx, `alter table effects add constraint effects_once unique (saga_id, step) deferrable initially deferred`)
			require.NoError(t, err)
			var runs atomic.Int32
			def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					runs.Add(1)
					return lastEffect(0)(ctx, sc)
				}})
			w, m := meteredWorker(t, pool, def, func(cfg *steps.Config) {
				cfg.Pool = pool
				if apply {
					cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
						return steps.Applied{Writes: a.Pending}, nil
					}
				}
			})
			id := uuid.New()
			_, err = pool.Exec(ctx, insertEffect, id, "write")
			require.NoError(t, err)

			trips.Reset()
			_, err = w.Handle(ctx, command(id, "last", "write", saga.PhaseForward, 1, 1))
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "23505", pgErr.Code)
			require.ErrorIs(t, err, pgbatch.ErrAtSync, "the failure came at the commit")
			require.Equal(t, int32(1), runs.Load(), "a failure at the commit is not the handler's to judge")
			require.Zero(t, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
			sent := trips.SentInBatches()
			require.GreaterOrEqual(t, len(sent), 2)
			require.NotContains(t, sent[0], "idle_in_transaction_session_timeout", "the first batch was the implicit transaction")
			require.NotEqual(t, "begin", sent[1], "the first batch was the implicit transaction")
			require.Equal(t, 1, countEffects(t, pool), "the step's effect did not commit")
			var claimed int
			require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.inbox where saga_id = $1`, id).Scan(&claimed))
			require.Zero(t, claimed, "the claim did not commit")
			requireNoOpenTransaction(t, pool)
		})
	}
}

// TestHeldBackStatementThatCannotBePrepared: a held-back statement that
// PostgreSQL cannot prepare (its table does not exist) fails before
// anything is sent, the claim it carries included. The error is the
// handler's to judge, as for a statement run at once: here it makes the
// step fail for good, and the failure is recorded, instead of the claim
// being reported as failing and the command delivered again forever.
func TestHeldBackStatementThatCannotBePrepared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := poolWith(t, effectsDB(t), func(*pgxpool.Config) {})
	var seen error
	def := saga.MustNew("last", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if err := sc.ExecLast(ctx, `insert into no_such_table (saga_id) values ($1)`, sc.SagaID); err != nil {
				seen = err
				return nil, saga.Permanent(err)
			}
			return nil, nil
		},
	})
	w, m := meteredWorker(t, pool, def, func(*steps.Config) {})
	id := uuid.New()
	reply, err := w.Handle(ctx, command(id, "last", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, seen, &pgErr, "the handler saw the statement's error")
	require.Equal(t, "42P01", pgErr.Code)
	require.Equal(t, wire.OutcomeFailed, reply.Outcome)
	require.Equal(t, 1.0, counter(t, m.LastStatementReruns.WithLabelValues("last", "write")))
	var outcome string
	require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where saga_id = $1`, id).Scan(&outcome))
	require.Equal(t, "failed", outcome)
}
