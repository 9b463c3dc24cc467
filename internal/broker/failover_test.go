package broker_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

// TestFailoverRedeliversWhatTheLostLeaderHeld: a message delivered by the
// leader of a 3-replica consumer and not acked when that node goes down
// (its ack lost with it, or the delivery itself) is delivered again within
// seconds of the new leader's election, not after AckWait, and once acked
// leaves the work queue empty.
func TestFailoverRedeliversWhatTheLostLeaderHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testenv.NATSCluster(t, 3)
	nc := cluster.Connect(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	var logs testenv.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	s, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "F", Subjects: []string{"f.>"}, Replicas: 3, Logger: logger})
	require.NoError(t, err)
	require.NotContains(t, logs.String(), "one replica")
	// A stream made without replicas on a cluster is warned about.
	_, err = broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "ONE", Subjects: []string{"one.>"}, Logger: logger})
	require.NoError(t, err)
	require.Contains(t, logs.String(), "one replica on a clustered server")
	require.Contains(t, logs.String(), "--stream-replicas 3")
	const ackWait = 2 * time.Minute
	c, err := broker.EnsureConsumer(ctx, s, broker.ConsumerConfig{Durable: "work", Filter: "f.>", AckWait: ackWait, MaxAckPending: 100})
	require.NoError(t, err)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	require.NoError(t, broker.RedeliverOnFailover(watchCtx, nc, js, broker.FailoverConfig{
		Stream: "F", ConsumerPrefixes: []string{"work"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}))

	leader := cluster.WaitStreamLeader("F", 10*time.Second)
	cluster.GatherConsumer(nc, "F", "work", leader, 10*time.Second)
	_, err = js.Publish(ctx, "f.x", []byte("held"))
	require.NoError(t, err)
	batch, err := c.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	var first jetstream.Msg
	for m := range batch.Messages() {
		first = m
	}
	require.NotNil(t, first, "the message is delivered before the kill")
	// Not acked: as if the ack, or the delivery, was lost with the node.
	killed := time.Now()
	cluster.Kill(leader)

	// Fetched and double-acked until the work queue is empty: a reset
	// makes deliveries in flight stale, and those are delivered again.
	var redelivered time.Duration
	var deliveries int
	require.Eventually(t, func() bool {
		if info, err := js.Stream(ctx, "F"); err == nil && info.CachedInfo().State.Msgs == 0 {
			return true
		}
		b, err := c.Fetch(1, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return false
		}
		for m := range b.Messages() {
			require.Equal(t, "held", string(m.Data()))
			if deliveries++; deliveries == 1 {
				redelivered = time.Since(killed)
			}
			actx, cancel := context.WithTimeout(ctx, time.Second)
			_ = m.DoubleAck(actx)
			cancel()
		}
		return false
	}, 30*time.Second, 10*time.Millisecond, "redelivered and acked after the failover, well before AckWait (%s)", ackWait)
	require.Positive(t, deliveries)
	t.Logf("redelivered %s after the kill (AckWait %s), %d deliveries", redelivered.Round(time.Millisecond), ackWait, deliveries)

	cluster.Restart(leader)
	cluster.WaitStreamLeader("F", 30*time.Second)
}

// TestNoResetAfterALoneServerRestarts: a lone server elects no leaders, and
// what it held comes back with it, so a reconnection to it resets nothing.
// Every process resetting after its restart would redeliver everything in
// flight once per process. The message delivered and not acked before the
// restart stays with its ack wait, not delivered again.
func TestNoResetAfterALoneServerRestarts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	srv := testenv.StartNATS(t, dir, -1)
	addr := srv.Addr().String()
	nc := testenv.Connect(t, srv.ClientURL())
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "L", Subjects: []string{"l.>"}})
	require.NoError(t, err)
	c, err := broker.EnsureConsumer(ctx, s, broker.ConsumerConfig{Durable: "work", Filter: "l.>", AckWait: 2 * time.Minute, MaxAckPending: 100})
	require.NoError(t, err)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	require.NoError(t, broker.RedeliverOnFailover(watchCtx, nc, js, broker.FailoverConfig{
		Stream: "L", ConsumerPrefixes: []string{"work"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}))
	_, err = js.Publish(ctx, "l.x", []byte("held"))
	require.NoError(t, err)
	batch, err := c.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	n := 0
	for range batch.Messages() {
		n++
	}
	require.Equal(t, 1, n, "delivered, not acked")

	srv.Shutdown()
	srv.WaitForShutdown()
	testenv.StartNATSAt(t, dir, addr)
	require.Eventually(t, func() bool { return nc.Stats().Reconnects > 0 && nc.IsConnected() }, 20*time.Second, 20*time.Millisecond)
	// The watcher looks at reconnections every second and a reset waits
	// 500 ms for others: past two looks, a reset would have redelivered.
	batch, err = c.Fetch(1, jetstream.FetchMaxWait(3*time.Second))
	require.NoError(t, err)
	for m := range batch.Messages() {
		t.Fatalf("message %q delivered again after a lone server's restart", m.Data())
	}
}

// TestDroppedDeliveriesAreRedelivered: messages a subscription of the
// connection dropped for want of room ("slow consumer"), as a client
// that reconnected and asked anew for what it had asked before does,
// are held by the server as delivered until AckWait; they are delivered
// again within seconds of the drop.
func TestDroppedDeliveriesAreRedelivered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartNATS(t, t.TempDir(), -1)
	var drops atomic.Int64
	nc, err := nats.Connect(srv.ClientURL(), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrSlowConsumer) {
			drops.Add(1)
		}
	}))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: "S", Subjects: []string{"s.>"}})
	require.NoError(t, err)
	const ackWait = 2 * time.Minute
	c, err := broker.EnsureConsumer(ctx, s, broker.ConsumerConfig{Durable: "work", Filter: "s.>", AckWait: ackWait, MaxAckPending: 100})
	require.NoError(t, err)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	require.NoError(t, broker.RedeliverOnFailover(watchCtx, nc, js, broker.FailoverConfig{
		Stream: "S", ConsumerPrefixes: []string{"work"}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}))

	// A pull for five messages into a buffer of one that nobody reads.
	// The messages are stored first, so the pull is answered in one burst
	// and is over before the reset: a pull still waiting would take the
	// redeliveries too, and drop them without a second error, since
	// nobody reads its subscription.
	const n = 5
	for i := range n {
		_, err := js.Publish(ctx, "s.x", fmt.Appendf(nil, "m-%d", i))
		require.NoError(t, err)
	}
	inbox := nc.NewInbox()
	sub, err := nc.ChanSubscribe(inbox, make(chan *nats.Msg, 1))
	require.NoError(t, err)
	defer func() { _ = sub.Unsubscribe() }()
	require.NoError(t, nc.PublishRequest("$JS.API.CONSUMER.MSG.NEXT.S.work", inbox, fmt.Appendf(nil, `{"batch":%d,"expires":%d}`, n, int64(5*time.Second))))
	require.Eventually(t, func() bool { return drops.Load() > 0 }, 10*time.Second, 10*time.Millisecond, "the client drops what its buffer cannot hold")

	got := map[string]bool{}
	require.Eventually(t, func() bool {
		b, err := c.Fetch(n, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return false
		}
		for m := range b.Messages() {
			got[string(m.Data())] = true
			_ = m.Ack()
		}
		return len(got) == n
	}, 20*time.Second, 10*time.Millisecond, "what was dropped is delivered again well before AckWait (%s): %d of %d", ackWait, len(got), n)
}
