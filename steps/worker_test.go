package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

func ledgerRows(t *testing.T, pool *pgxpool.Pool, sagaID uuid.UUID) map[string]int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select step, amount from fixture.ledger where saga_id = $1`, sagaID)
	require.NoError(t, err)
	out := map[string]int64{}
	for rows.Next() {
		var s string
		var a int64
		require.NoError(t, rows.Scan(&s, &a))
		out[s] = a
	}
	require.NoError(t, rows.Err())
	return out
}

func balance(t *testing.T, pool *pgxpool.Pool, id int64) int64 {
	var b int64
	require.NoError(t, pool.QueryRow(context.Background(), `select balance from fixture.accounts where id = $1`, id).Scan(&b))
	return b
}

// TestSameCommandConcurrently runs one command from 32 goroutines at once
// (as many workers receiving redeliveries would), half of them as
// redeliveries (HandleRedelivered), over three attempts: one effect, one
// outcome.
func TestSameCommandConcurrently(t *testing.T) {
	t.Parallel()
	def := fixture.Default
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	// Remembering nothing, the worker sends every delivery to the
	// database, as many workers would.
	w, err := steps.New(steps.Config{
		Pool: pool, SubjectPrefix: "t", Definitions: []*saga.Definition{def},
		Recent: -1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	id := testenv.NewSaga(t, pool, "transfer")

	const n = 32
	replies := make([]wire.Reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			cmd := testenv.Command(id, "transfer", fixture.StepDeduct, saga.PhaseForward, 1+i%3, fixture.Input{From: 1, To: 2, Amount: 30})
			if i%2 == 1 {
				// A redelivery reads the inbox before it claims.
				replies[i], errs[i] = w.HandleRedelivered(ctx, cmd)
			} else {
				replies[i], errs[i] = w.Handle(ctx, cmd)
			}
		})
	}
	close(gate)
	wg.Wait()
	fresh, winner := 0, 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, wire.OutcomeSucceeded, replies[i].Outcome)
		require.JSONEq(t, `{"account":1,"amount":-30}`, string(replies[i].Result), "every delivery returns the first outcome")
		require.Equal(t, 1+i%3, replies[i].Attempt, "the reply answers the attempt it was asked")
		if !replies[i].Duplicate {
			fresh++
			winner = replies[i].Attempt
		}
	}
	require.Equal(t, 1, fresh, "one delivery ran the handler")
	require.Equal(t, int64(70), balance(t, pool, 1), "debited once")
	require.Equal(t, map[string]int64{"deduct": -30}, ledgerRows(t, pool, id))

	// The winning attempt's reply is in the outbox once: a delivery of the
	// same attempt adds nothing. A delivery of another attempt is answered
	// under its own attempt, which the orchestrator is waiting for.
	otherAttempts := 0
	for i := range n {
		if 1+i%3 != winner {
			otherAttempts++
		}
	}
	rows, err := pool.Query(ctx, `select msg_id from idemsaga.outbox`)
	require.NoError(t, err)
	msgIDs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, msgIDs, 1+otherAttempts, "one reply for the winner, one per delivery of another attempt")
	perAttempt := map[string]int{}
	for _, m := range msgIDs {
		perAttempt[m]++
	}
	require.Equal(t, 1, perAttempt["r-"+saga.MessageID(saga.StepKey(id, fixture.StepDeduct, saga.PhaseForward), winner)+"-succeeded"])
}

// TestHandlerErrorRollsBackInbox: a failing attempt leaves no business
// write, and its key records only that the attempt ended (retry), so the
// next attempt claims it and does the work.
func TestHandlerErrorRollsBackInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 1, 100)
	require.NoError(t, err)
	var calls atomic.Int32
	def := saga.MustNew("flaky", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if _, err := sc.Tx.Exec(ctx, `update fixture.accounts set balance = balance + 1 where id = 1`); err != nil {
				return nil, err
			}
			if calls.Add(1) == 1 {
				return nil, errors.New("downstream timed out")
			}
			return json.RawMessage(`"ok"`), nil
		},
	})
	w := newWorker(t, pool, def)
	id := testenv.NewSaga(t, pool, "flaky")

	r, err := w.Handle(ctx, testenv.Command(id, "flaky", "write", saga.PhaseForward, 1, map[string]int{}))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeRetry, r.Outcome)
	require.Contains(t, r.Error, "downstream timed out")
	var outcome string
	var attempt int
	require.NoError(t, pool.QueryRow(ctx, `select outcome, attempt from idemsaga.inbox`).Scan(&outcome, &attempt))
	require.Equal(t, []any{"retry", 1}, []any{outcome, attempt}, "the key records the attempt's end, not an effect")
	require.Equal(t, int64(100), balance(t, pool, 1))

	r, err = w.Handle(ctx, testenv.Command(id, "flaky", "write", saga.PhaseForward, 2, map[string]int{}))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
	require.False(t, r.Duplicate)
	require.Equal(t, int64(101), balance(t, pool, 1))
}

func TestPermanentFailureIsRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 2, 10)
	require.NoError(t, err)
	w := newWorker(t, pool, fixture.Default)
	id := testenv.NewSaga(t, pool, "transfer")
	cmd := testenv.Command(id, "transfer", fixture.StepDeduct, saga.PhaseForward, 1, fixture.Input{From: 1, To: 2, Amount: 50})
	r, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeFailed, r.Outcome)
	require.Contains(t, r.Error, "insufficient funds")

	// Money arrives; a redelivery must still return the first outcome.
	_, err = pool.Exec(ctx, `update fixture.accounts set balance = 1000 where id = 1`)
	require.NoError(t, err)
	again, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, wire.OutcomeFailed, again.Outcome)
	require.Empty(t, ledgerRows(t, pool, id))
}

// TestCompensationTombstonesForward: a compensation that arrives before its
// forward command fences the key, so the late forward does nothing; a
// compensation after a forward that ran undoes it, once.
func TestCompensationTombstonesForward(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	w := newWorker(t, pool, fixture.Default)
	in := fixture.Input{From: 1, To: 2, Amount: 25}

	// Forward never ran: compensation is a no-op and fences it.
	lost := testenv.NewSaga(t, pool, "transfer")
	r, err := w.Handle(ctx, testenv.Command(lost, "transfer", fixture.StepDeduct, saga.PhaseCompensate, 1, in))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
	late, err := w.Handle(ctx, testenv.Command(lost, "transfer", fixture.StepDeduct, saga.PhaseForward, 3, in))
	require.NoError(t, err)
	require.True(t, late.Duplicate)
	require.Equal(t, wire.OutcomeFailed, late.Outcome)
	require.Empty(t, ledgerRows(t, pool, lost))
	require.Equal(t, int64(100), balance(t, pool, 1))

	// Forward ran: compensation refunds, and only once under concurrency.
	ran := testenv.NewSaga(t, pool, "transfer")
	_, err = w.Handle(ctx, testenv.Command(ran, "transfer", fixture.StepDeduct, saga.PhaseForward, 1, in))
	require.NoError(t, err)
	require.Equal(t, int64(75), balance(t, pool, 1))
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			_, err := w.Handle(ctx, testenv.Command(ran, "transfer", fixture.StepDeduct, saga.PhaseCompensate, 1+i%2, in))
			require.NoError(t, err)
		})
	}
	wg.Wait()
	require.Equal(t, int64(100), balance(t, pool, 1))
	require.Equal(t, map[string]int64{"deduct": -25, "refund": 25}, ledgerRows(t, pool, ran))
}

func TestHandlerPanicIsRetryable(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	def := saga.MustNew("panicky", saga.Step{Kind: saga.DatabaseStep, Name: "boom", Reaches: "boomed",
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { panic("kaboom") }})
	w := newWorker(t, pool, def)
	r, err := w.Handle(context.Background(), testenv.Command(testenv.NewSaga(t, pool, "panicky"), "panicky", "boom", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeRetry, r.Outcome)
	require.Contains(t, r.Error, "kaboom")
}

func TestUnknownDefinitionIsNotAcked(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	w := newWorker(t, pool, fixture.Default)
	_, err := w.Handle(context.Background(), testenv.Command(testenv.NewSaga(t, pool, "nope"), "nope", "x", saga.PhaseForward, 1, 1))
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
}

// TestRememberedAttemptSkipsTheDatabase: a worker that answered an attempt
// answers another delivery of it from memory, with the same outcome and
// nothing written; a worker that does not remember (Recent -1) finds the
// same answer in the inbox. A retryable failure ends its attempt too: its
// redelivery is answered from memory, and the handler does not run again;
// the next attempt runs it.
func TestRememberedAttemptSkipsTheDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	w := newWorker(t, pool, fixture.Default)
	id := testenv.NewSaga(t, pool, "transfer")
	cmd := testenv.Command(id, "transfer", fixture.StepDeduct, saga.PhaseForward, 1, fixture.Input{From: 1, To: 2, Amount: 30})
	first, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.False(t, first.Duplicate)

	// Hide the inbox row: only the worker's memory can answer now.
	_, err = pool.Exec(ctx, `update idemsaga.inbox set step_key = gen_random_uuid() where saga_id = $1`, pguuid.Of(id))
	require.NoError(t, err)
	again, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, first.Outcome, again.Outcome)
	require.JSONEq(t, string(first.Result), string(again.Result))
	require.Equal(t, int64(70), balance(t, pool, 1), "debited once")
	_, err = pool.Exec(ctx, `update idemsaga.inbox set step_key = $2 where saga_id = $1`, pguuid.Of(id), pguuid.Of(cmd.Key))
	require.NoError(t, err)

	forgetful, err := steps.New(steps.Config{
		Pool: pool, SubjectPrefix: "t", Definitions: []*saga.Definition{fixture.Default},
		Recent: -1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	fromInbox, err := forgetful.Handle(ctx, cmd)
	require.NoError(t, err)
	require.True(t, fromInbox.Duplicate)
	require.JSONEq(t, string(first.Result), string(fromInbox.Result))
	var outbox int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox`).Scan(&outbox))
	require.Equal(t, 1, outbox, "one reply, written by the first delivery")

	// A retryable failure, then its redelivery: a duplicate; then the next
	// attempt succeeds.
	var runs atomic.Int32
	flaky, err := saga.New("flaky", saga.Step{Kind: saga.DatabaseStep, Name: "s", Reaches: "done", Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if runs.Add(1) == 1 {
			return nil, errors.New("not yet")
		}
		return json.RawMessage(`"ok"`), nil
	}})
	require.NoError(t, err)
	fw := newWorker(t, pool, flaky)
	fc := testenv.Command(testenv.NewSaga(t, pool, "flaky"), "flaky", "s", saga.PhaseForward, 1, nil)
	r1, err := fw.Handle(ctx, fc)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeRetry, r1.Outcome)
	r2, err := fw.Handle(ctx, fc)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeRetry, r2.Outcome)
	require.True(t, r2.Duplicate)
	require.Equal(t, int32(1), runs.Load())
	fc.Attempt = 2
	r3, err := fw.Handle(ctx, fc)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, r3.Outcome)
	require.False(t, r3.Duplicate)
	require.Equal(t, int32(2), runs.Load())
}

// TestStartRefusesADatabaseBehindItsMigrations: a step worker started on a
// database whose schema is not this build's (behind, as in a rolling
// upgrade that skipped `worker migrate`) fails at Start, saying what to do,
// and consumes nothing: every command would be refused and delivered
// again.
func TestStartRefusesADatabaseBehindItsMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `update idemsaga.schema_version set version = version - 1`)
	require.NoError(t, err)
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	w, err := steps.New(steps.Config{
		Pool: pool, NATS: nc, Stream: "BEHIND", SubjectPrefix: "t", Definitions: []*saga.Definition{fixture.Default},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	require.ErrorContains(t, w.Start(ctx), "apply the migrations first")
	require.NoError(t, w.Stop(ctx), "stopping a worker that never started is fine")
	_, err = js.Stream(ctx, "BEHIND")
	require.ErrorIs(t, err, jetstream.ErrStreamNotFound, "nothing consumed: the worker did not even create its stream")

	_, err = pool.Exec(ctx, `update idemsaga.schema_version set version = version + 1`)
	require.NoError(t, err)
	require.NoError(t, w.Start(ctx), "the same worker starts once the database is migrated")
	require.NoError(t, w.Stop(ctx))
}
