package maintenance

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

// TestBacklogCountsWhatNoWorkerWasGiven: the backlog is the consumers'
// undelivered messages and the oldest of them, not the work queue's
// whole content. A message a worker took and never acknowledged (it died)
// stays in the stream, but it is not queued work: counting it would shed
// starts, and hold back the re-send of lost commands, for an AckWait
// after every crash.
func TestBacklogCountsWhatNoWorkerWasGiven(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	name := testenv.Name("BACKLOG")
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"b." + name + ".>"}, Retention: jetstream.WorkQueuePolicy})
	require.NoError(t, err)
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name + "_steps", FilterSubject: "b." + name + ".cmd.>",
		AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Hour})
	require.NoError(t, err)
	_, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name + "_orchestrator", FilterSubject: "b." + name + ".reply.>",
		AckPolicy: jetstream.AckExplicitPolicy})
	require.NoError(t, err)
	sb := NewStreamBacklog(js, name, name+"_steps", name+"_orchestrator")

	empty, err := sb.read(ctx)
	require.NoError(t, err)
	require.Zero(t, empty.Msgs)
	require.Zero(t, empty.OldestAge(time.Now()))

	// Spaced apart, so that which one is the oldest shows in its age.
	var stored []time.Time
	for i := range 5 {
		if i > 0 {
			time.Sleep(200 * time.Millisecond)
		}
		ack, err := js.Publish(ctx, "b."+name+".cmd.x", []byte("c"))
		require.NoError(t, err)
		m, err := s.GetMsg(ctx, ack.Sequence)
		require.NoError(t, err)
		stored = append(stored, m.Time)
	}
	_, err = js.Publish(ctx, "b."+name+".reply.x", []byte("r"))
	require.NoError(t, err)
	// The server counts a consumer's pending messages a moment after it
	// stored them.
	var b Backlog
	require.Eventually(t, func() bool {
		b, err = sb.read(ctx)
		return err == nil && b.Msgs == 6
	}, 30*time.Second, 10*time.Millisecond, "5 commands and 1 reply wait")
	require.WithinDuration(t, stored[0], b.Oldest, 100*time.Millisecond, "the oldest is the first command")

	// A worker takes two commands and dies without acknowledging them.
	batch, err := c.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	n := 0
	for range batch.Messages() {
		n++
	}
	require.Equal(t, 2, n)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(6), info.State.Msgs, "the work queue still holds the two")
	b, err = sb.read(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(4), b.Msgs, "3 commands and 1 reply wait for a worker")
	require.WithinDuration(t, stored[2], b.Oldest, 100*time.Millisecond, "the oldest waiting is the third command, not the ones delivered")
}

// TestStoredAtAcrossClocks: a message's age is taken on the broker's clock,
// whatever this host's says; a server that does not tell its time leaves
// the stored time alone.
func TestStoredAtAcrossClocks(t *testing.T) {
	t.Parallel()
	local := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	brokerNow := local.Add(-time.Hour) // the broker's clock an hour behind
	stored := brokerNow.Add(-7 * time.Second)
	require.Equal(t, local.Add(-7*time.Second), storedAt(stored, brokerNow, local))
	require.Equal(t, stored, storedAt(stored, time.Time{}, local))
}
