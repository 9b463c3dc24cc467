package broker_test

import (
	"context"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestEnsureIsIdempotentAndUpdatesOnlyOnChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	cfg := broker.StreamConfig{Name: "S", Subjects: []string{"s.>"}}
	s1, err := broker.EnsureStream(ctx, js, cfg)
	require.NoError(t, err)
	s2, err := broker.EnsureStream(ctx, js, cfg)
	require.NoError(t, err)
	require.Equal(t, s1.CachedInfo().Created, s2.CachedInfo().Created)
	require.Equal(t, broker.DuplicateWindowDefault, s2.CachedInfo().Config.Duplicates)

	cfg.DuplicateWindow = time.Minute
	s3, err := broker.EnsureStream(ctx, js, cfg)
	require.NoError(t, err)
	require.Equal(t, time.Minute, s3.CachedInfo().Config.Duplicates, "a changed window is applied")

	cc := broker.ConsumerConfig{Durable: "D", Filter: "s.x.>", AckWait: 5 * time.Second, MaxAckPending: 10}
	c1, err := broker.EnsureConsumer(ctx, s3, cc)
	require.NoError(t, err)
	c2, err := broker.EnsureConsumer(ctx, s3, cc)
	require.NoError(t, err)
	require.Equal(t, c1.CachedInfo().Created, c2.CachedInfo().Created)
	cc.AckWait = 7 * time.Second
	c3, err := broker.EnsureConsumer(ctx, s3, cc)
	require.NoError(t, err)
	require.Equal(t, 7*time.Second, c3.CachedInfo().Config.AckWait)
}

// TestPoolResumesAfterTheConsumerIsDeleted: the server loses the consumer;
// the pool notices (missing heartbeats or a deleted-consumer status),
// recreates it through its ConsumerFunc and goes on consuming.
func TestPoolResumesAfterTheConsumerIsDeleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	streamCfg := broker.StreamConfig{Name: "P", Subjects: []string{"p.>"}}
	consumerCfg := broker.ConsumerConfig{Durable: "pool", Filter: "p.>", AckWait: 5 * time.Second, MaxAckPending: 100}
	var ensured atomic.Int32
	get := func(ctx context.Context) (jetstream.Consumer, error) {
		ensured.Add(1)
		s, err := broker.EnsureStream(ctx, js, streamCfg)
		if err != nil {
			return nil, err
		}
		return broker.EnsureConsumer(ctx, s, consumerCfg)
	}
	var got atomic.Int32
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		broker.Pool(runCtx, slog.New(slog.NewTextHandler(io.Discard, nil)), get, 2, func(_ context.Context, m jetstream.Msg) {
			got.Add(1)
			_ = m.Ack()
		})
	}()
	defer func() { cancel(); <-done }()

	publish := func() {
		_, err := js.Publish(ctx, "p.x", []byte("x"))
		require.NoError(t, err)
	}
	publish()
	require.Eventually(t, func() bool { return got.Load() == 1 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, js.DeleteConsumer(ctx, "P", "pool"))
	// A message published while the consumer is being replaced is not
	// always delivered by the new one (seen about once in fifteen runs;
	// the engine re-drives such a message through its lease). What must
	// hold is that consuming resumes: publish until something arrives.
	require.Eventually(t, func() bool {
		if got.Load() >= 2 {
			return true
		}
		publish()
		return false
	}, 30*time.Second, 500*time.Millisecond, "consuming resumed after the consumer was recreated")
	require.GreaterOrEqual(t, ensured.Load(), int32(2))
}
