package steps_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestHandleMsgReadsTheInboxOnARedelivery: JetStream delivers a command a
// second time after its first delivery committed and the ack was lost (a
// Nak here, so as not to wait for AckWait). HandleMsg sees the delivery
// count and answers with a plain read of the inbox, without the claim, and
// acks: the command is not delivered a third time. The redelivery reaches
// another worker, which does not remember the first.
func TestHandleMsgReadsTheInboxOnARedelivery(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	shared := effectsDB(t)
	trips := &testenv.RoundTrips{}
	pool := poolWith(t, shared, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = trips })
	def := saga.MustNew("lost", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, $2)`, sc.SagaID, sc.Step)
			return nil, err
		},
	})
	w := newWorker(t, pool, def)

	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "LOST", Subjects: []string{"t.>"}})
	require.NoError(t, err)
	cons, err := broker.EnsureConsumer(ctx, stream, broker.ConsumerConfig{Durable: "lost", Filter: "t.cmd.>", AckWait: time.Minute, MaxAckPending: 10})
	require.NoError(t, err)
	cmd := command(uuid.New(), "lost", "write", saga.PhaseForward, 1, 1)
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
	first := next()
	_, err = w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.NoError(t, first.Nak()) // the ack that was lost

	again := next()
	md, err := again.Metadata()
	require.NoError(t, err)
	require.Equal(t, uint64(2), md.NumDelivered)
	trips.Reset()
	newWorker(t, pool, def).HandleMsg(ctx, again) // another process: nothing remembered
	require.Equal(t, []int32{0, 1}, []int32{trips.Batches.Load(), trips.Alone.Load()}, "batches, statements alone")
	require.Contains(t, trips.SentAlone()[0], "select i.outcome", "the inbox is read, not claimed")

	// The ack is not confirmed by the server (HandleMsg does not double
	// ack): wait for the consumer to show it.
	require.Eventually(t, func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	}, 10*time.Second, 20*time.Millisecond, "acknowledged, nothing left to deliver")
	require.Equal(t, 1, countEffects(t, pool))
}
