package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// TestHandleMsgReadsTheInboxOnARedelivery: a command's first delivery
// commits, and its ack is lost (failpoint step-redeliver: a Nak instead).
// JetStream delivers it again, with NumDelivered 2, to another worker,
// which remembers nothing: HandleMsg sees the count and answers with a
// plain read of the inbox, without the claim, writes nothing, and acks, so
// the command is not delivered a third time. Not parallel: failpoints are
// the process's, and no parallel test of this package runs alongside.
func TestHandleMsgReadsTheInboxOnARedelivery(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, trips, shared := tracedEffectsDB(t)
	def := saga.MustNew("lost", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			return nil, writeEffect(ctx, sc)
		},
	})
	other, err := steps.New(steps.Config{
		Pool: pool, SubjectPrefix: "t", Definitions: []*saga.Definition{def},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	m := other.Metrics()

	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "LOST", Subjects: []string{"t.>"}})
	require.NoError(t, err)
	cons, err := broker.EnsureConsumer(ctx, stream, broker.ConsumerConfig{Durable: "lost", Filter: "t.cmd.>", AckWait: time.Minute, MaxAckPending: 10})
	require.NoError(t, err)
	cmd := testenv.Command(testenv.NewSaga(t, shared, "lost"), "lost", "write", saga.PhaseForward, 1, 1)
	data, err := json.Marshal(cmd)
	require.NoError(t, err)
	_, err = js.Publish(ctx, "t.cmd.lost.write", data)
	require.NoError(t, err)
	next := func() jetstream.Msg {
		t.Helper()
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		for m := range batch.Messages() {
			return m
		}
		require.NoError(t, batch.Error())
		t.Fatal("no delivery")
		return nil
	}
	outbox := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where saga_id = $1`, pguuid.Of(cmd.SagaID)).Scan(&n))
		return n
	}

	require.NoError(t, failpoint.Enable(failpoint.StepRedeliver+"=error"))
	defer failpoint.Disable()
	newWorker(t, pool, def).HandleMsg(ctx, next())
	require.Equal(t, int64(1), failpoint.Hits(failpoint.StepRedeliver), "the first delivery's ack was lost")
	replies := outbox()
	require.Equal(t, 1, replies, "the first delivery's reply")

	again := next()
	md, err := again.Metadata()
	require.NoError(t, err)
	require.Equal(t, uint64(2), md.NumDelivered)
	trips.Reset()
	other.HandleMsg(ctx, again)
	require.Equal(t, int64(1), failpoint.Hits(failpoint.StepRedeliver), "the failpoint spares a redelivery")
	require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
	require.Contains(t, trips.SentAlone()[0], "select i.outcome", "the inbox is read, not claimed")
	require.Equal(t, 1.0, counter(t, m.Duplicates.WithLabelValues(metrics.LayerInbox)))
	require.Zero(t, counter(t, m.UniqueConflicts.WithLabelValues("inbox")), "no insert met the inbox row")

	// The ack is not confirmed by the server (HandleMsg does not double
	// ack): wait for the consumer to show it.
	require.Eventually(t, func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0 && info.NumRedelivered == 0
	}, 10*time.Second, 20*time.Millisecond, "acknowledged, nothing left to deliver")
	require.Equal(t, replies, outbox(), "the redelivery wrote nothing")
	require.Equal(t, 1, countEffects(t, pool))
}

// TestARedeliveryAnswersAsTheClaimDoes sets up each thing the inbox can
// hold for a key, twice, and delivers the command again: once through the
// claim (Handle) and once through the read (HandleRedelivered), each to a
// worker that remembers nothing. Both answer alike and write alike: no
// effect, and a reply only for another attempt.
func TestARedeliveryAnswersAsTheClaimDoes(t *testing.T) {
	t.Parallel()
	type setup func(t *testing.T, pool *pgxpool.Pool, w *steps.Worker, id uuid.UUID)
	ran := func(attempt int) setup {
		return func(t *testing.T, _ *pgxpool.Pool, w *steps.Worker, id uuid.UUID) {
			_, err := w.Handle(context.Background(), testenv.Command(id, "eq", "write", saga.PhaseForward, attempt, 1))
			require.NoError(t, err)
		}
	}
	for _, tc := range []struct {
		name    string
		result  json.RawMessage
		err     error
		setup   setup
		attempt int // of the delivery again
	}{
		{name: "a success", result: json.RawMessage(`{"a":1}`), setup: ran(1), attempt: 1},
		{name: "a success of another attempt", result: json.RawMessage(`{"a":1}`), setup: ran(1), attempt: 2},
		{name: "a JSON null result", result: json.RawMessage(`null`), setup: ran(1), attempt: 1},
		{name: "a permanent failure", err: saga.Permanent(errors.New("declined")), setup: ran(1), attempt: 1},
		{name: "a tombstone", setup: func(t *testing.T, _ *pgxpool.Pool, w *steps.Worker, id uuid.UUID) {
			_, err := w.Handle(context.Background(), testenv.Command(id, "eq", "write", saga.PhaseCompensate, 1, 1))
			require.NoError(t, err)
		}, attempt: 1},
		{name: "a result kept in the step's row", setup: func(t *testing.T, pool *pgxpool.Pool, _ *steps.Worker, id uuid.UUID) {
			// As a success applied to its saga in its step leaves it.
			ctx := context.Background()
			key := saga.StepKey(id, "write", saga.PhaseForward)
			_, err := pool.Exec(ctx, `insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, result)
values ($1, 'write', 'forward', 0, $2, 'succeeded', 1, '{"kept":2}')`, pguuid.Of(id), pguuid.Of(key))
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome) values ($1, $2, 'write', 'forward', 1, 'succeeded')`, pguuid.Of(key), pguuid.Of(id))
			require.NoError(t, err)
		}, attempt: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := effectsDB(t)
			def := saga.MustNew("eq", saga.Step{
				Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if err := writeEffect(ctx, sc); err != nil {
						return nil, err
					}
					return tc.result, tc.err
				},
				Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			})
			var answers [2]wire.Reply
			var writes [2][2]int // effects, outbox rows: added by the delivery
			for i, redelivered := range []bool{false, true} {
				id := testenv.NewSaga(t, pool, "eq")
				tc.setup(t, pool, newWorker(t, pool, def), id)
				count := func() [2]int {
					var c [2]int
					require.NoError(t, pool.QueryRow(ctx, `select (select count(*) from effects where saga_id = $1), (select count(*) from idemsaga.outbox where saga_id = $1)`, pguuid.Of(id)).Scan(&c[0], &c[1]))
					return c
				}
				before := count()
				w := newWorker(t, pool, def)
				cmd := testenv.Command(id, "eq", "write", saga.PhaseForward, tc.attempt, 1)
				var err error
				if redelivered {
					answers[i], err = w.HandleRedelivered(ctx, cmd)
				} else {
					answers[i], err = w.Handle(ctx, cmd)
				}
				require.NoError(t, err)
				after := count()
				writes[i] = [2]int{after[0] - before[0], after[1] - before[1]}
				answers[i].SagaID, answers[i].Key = uuid.Nil, uuid.Nil
			}
			require.True(t, answers[0].Duplicate)
			require.Equal(t, answers[0], answers[1], "the claim's answer, then the read's")
			require.Equal(t, writes[0], writes[1], "effects and outbox rows the claim's delivery added, then the read's")
			require.Zero(t, writes[1][0], "no effect")
		})
	}
}

// TestCommandOfAnotherDefinition: a worker that does not run a command's
// definition drops it when its saga finished, and otherwise hands it
// back for a worker that runs it, not at once: it is not offered again
// within a second.
func TestCommandOfAnotherDefinition(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := testenv.DB(t)
	mine := saga.MustNew("mine", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	w, err := steps.New(steps.Config{Pool: pool, SubjectPrefix: "o", Definitions: []*saga.Definition{mine}, Logger: quiet()})
	require.NoError(t, err)
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "OTHER", Subjects: []string{"o.>"}})
	require.NoError(t, err)
	cons, err := broker.EnsureConsumer(ctx, stream, broker.ConsumerConfig{Durable: "other", Filter: "o.cmd.>", AckWait: time.Minute, MaxAckPending: 10})
	require.NoError(t, err)

	finished := testenv.NewSaga(t, pool, "theirs")
	_, err = pool.Exec(ctx, `update idemsaga.sagas set state = 'compensated', finished_at = now() where id = $1`, pguuid.Of(finished))
	require.NoError(t, err)
	running := testenv.NewSaga(t, pool, "theirs")
	for _, id := range []uuid.UUID{finished, running} {
		data, err := json.Marshal(testenv.Command(id, "theirs", "s", saga.PhaseForward, 1, nil))
		require.NoError(t, err)
		_, err = js.Publish(ctx, "o.cmd.theirs.s", data)
		require.NoError(t, err)
	}
	batch, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	n := 0
	for m := range batch.Messages() {
		w.HandleMsg(ctx, m)
		n++
	}
	require.Equal(t, 2, n)
	again, err := cons.Fetch(1, jetstream.FetchMaxWait(time.Second))
	require.NoError(t, err)
	for range again.Messages() {
		t.Fatal("a command was offered again at once")
	}
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, info.NumAckPending, "the running saga's command waits to be offered again; the finished one's is gone")
}
