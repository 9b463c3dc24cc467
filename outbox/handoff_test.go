package outbox_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/outbox"
)

// commitHandedOff writes msgs in one transaction with the given hand-off
// and returns the committed rows, for Publish.
func commitHandedOff(t *testing.T, pool *pgxpool.Pool, handOff time.Duration, msgs ...outbox.Message) []outbox.Committed {
	t.Helper()
	ctx := context.Background()
	var rows []outbox.Committed
	b := &pgx.Batch{}
	b.Queue("begin")
	for _, m := range msgs {
		require.NoError(t, outbox.QueueHandedOff(b, m, handOff, func(c outbox.Committed) { rows = append(rows, c) }))
	}
	b.Queue("commit")
	require.NoError(t, pool.SendBatch(ctx, b).Close())
	require.Len(t, rows, len(msgs))
	return rows
}

func startRelay(t *testing.T, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	r, err := outbox.NewRelay(cfg)
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, r.Stop(context.Background())) })
	return r
}

func outboxRows(t *testing.T, pool *pgxpool.Pool, where string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.outbox where `+where).Scan(&n))
	return n
}

func streamMsgs(t *testing.T, s jetstream.Stream) uint64 {
	t.Helper()
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.Msgs
}

// TestPublishAfterCommit: rows handed to Publish reach the broker once each
// and are deleted once acknowledged, without the relay's sweep (their
// hand-off is an hour away).
func TestPublishAfterCommit(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "HANDOFF")
	r := startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: 5 * time.Millisecond, BatchSize: 7})

	var msgs []outbox.Message
	for i := range 20 {
		id := fmt.Sprintf("m%d", i)
		msgs = append(msgs, outbox.Message{Subject: name + ".x", MsgID: id, Payload: []byte(id), Headers: map[string]string{"X-Row": id}})
	}
	rows := commitHandedOff(t, pool, time.Hour, msgs...)
	r.Publish(rows...)
	require.Eventually(t, func() bool { return outboxRows(t, pool, "true") == 0 }, 10*time.Second, 5*time.Millisecond, "acknowledged rows deleted")
	require.EqualValues(t, 20, streamMsgs(t, stream))

	cons, err := stream.OrderedConsumer(context.Background(), jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	batch, err := cons.Fetch(20, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	seen := map[string]bool{}
	for m := range batch.Messages() {
		require.Equal(t, string(m.Data()), m.Headers().Get("X-Row"))
		seen[string(m.Data())] = true
	}
	require.Len(t, seen, 20)
}

// TestSweepTakesOverWhatWasNotPublished: rows whose writer never published
// them (a crash between commit and publish) wait for their hand-off, then
// the relay publishes them; a row whose hand-off has not passed stays.
func TestSweepTakesOverWhatWasNotPublished(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "SWEEP")
	startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: 5 * time.Millisecond})

	commitHandedOff(t, pool, time.Hour, outbox.Message{Subject: name + ".x", MsgID: "later", Payload: []byte("later")})
	commitHandedOff(t, pool, 300*time.Millisecond,
		outbox.Message{Subject: name + ".x", MsgID: "a", Payload: []byte("a")},
		outbox.Message{Subject: name + ".x", MsgID: "b", Payload: []byte("b")})

	require.Eventually(t, func() bool { return outboxRows(t, pool, "true") == 1 }, 10*time.Second, 5*time.Millisecond, "rows past their hand-off are swept")
	require.EqualValues(t, 2, streamMsgs(t, stream))
	require.Equal(t, 1, outboxRows(t, pool, "msg_id = 'later'"), "a row still handed off is left to its writer")
}

// TestPublishOnAStoppedRelayLeavesRowsToTheSweep: nothing is published or
// deleted; a running relay takes the rows over after their hand-off.
func TestPublishOnAStoppedRelayLeavesRowsToTheSweep(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "STOPPED")
	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	rows := commitHandedOff(t, pool, 200*time.Millisecond, outbox.Message{Subject: name + ".x", MsgID: "a", Payload: []byte("a")})
	r.Publish(rows...)
	require.Zero(t, streamMsgs(t, stream))
	require.Equal(t, 1, outboxRows(t, pool, "true"))

	startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: 5 * time.Millisecond})
	require.Eventually(t, func() bool { return outboxRows(t, pool, "true") == 0 }, 10*time.Second, 5*time.Millisecond)
	require.EqualValues(t, 1, streamMsgs(t, stream))
}

// TestPublishRacesTheSweep: writers commit and publish while three relays
// sweep with a hand-off so short that they take the same rows over at once.
// Every row reaches the stream exactly once (the broker drops the second
// copy by its message id) and the outbox drains.
func TestPublishRacesTheSweep(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "RACE")
	var relays []*outbox.Relay
	for range 3 {
		relays = append(relays, startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: time.Millisecond, BatchSize: 5, SettleInterval: 3 * time.Millisecond}))
	}
	const writers, perWriter = 8, 40
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range perWriter {
				id := fmt.Sprintf("w%d-%d", w, i)
				rows := commitHandedOff(t, pool, time.Millisecond, outbox.Message{Subject: name + ".x", MsgID: id, Payload: []byte(id)})
				relays[(w+i)%len(relays)].Publish(rows...)
			}
		})
	}
	wg.Wait()
	require.Eventually(t, func() bool { return outboxRows(t, pool, "true") == 0 }, 30*time.Second, 5*time.Millisecond, "outbox drained")
	require.EqualValues(t, writers*perWriter, streamMsgs(t, stream), "each row is in the stream exactly once")
}

// TestPublishMarksWhenKeepingPublished: with KeepPublished, acknowledged
// rows are marked, and the sweep does not publish them again.
func TestPublishMarksWhenKeepingPublished(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "HKEEP")
	r := startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, KeepPublished: true, PollInterval: 5 * time.Millisecond})
	rows := commitHandedOff(t, pool, time.Millisecond,
		outbox.Message{Subject: name + ".x", MsgID: "a", Payload: []byte("a")},
		outbox.Message{Subject: name + ".x", MsgID: "b", Payload: []byte("b")})
	r.Publish(rows...)
	require.Eventually(t, func() bool { return outboxRows(t, pool, "published_at is not null") == 2 }, 10*time.Second, 5*time.Millisecond)
	require.EqualValues(t, 2, streamMsgs(t, stream))
}

func TestQueueHandedOffValidates(t *testing.T) {
	t.Parallel()
	b := &pgx.Batch{}
	require.ErrorContains(t, outbox.QueueHandedOff(b, outbox.Message{Subject: "s", MsgID: "x"}, 0, func(outbox.Committed) {}), "positive duration")
	require.ErrorContains(t, outbox.QueueHandedOff(b, outbox.Message{MsgID: "x"}, time.Second, func(outbox.Committed) {}), "empty subject")
	require.Zero(t, b.Len(), "nothing queued")
}

// TestPublishLeavesRowsToTheSweepWhileTheBrokerIsAway: with its connection
// down, Publish leaves the rows alone (the committing goroutine does not
// wait for the broker); a relay with a connection sweeps them after their
// hand-off.
func TestPublishLeavesRowsToTheSweepWhileTheBrokerIsAway(t *testing.T) {
	t.Parallel()
	pool, _, js, stream, name := relayEnv(t, "AWAY")
	srv, _ := testenv.NATS(t)
	down := testenv.Connect(t, srv.ClientURL())
	downJS, err := jetstream.New(down)
	require.NoError(t, err)
	r := startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: downJS, PollInterval: time.Hour})
	down.Close()

	rows := commitHandedOff(t, pool, 300*time.Millisecond,
		outbox.Message{Subject: name + ".x", MsgID: "a", Payload: []byte("a")},
		outbox.Message{Subject: name + ".x", MsgID: "b", Payload: []byte("b")})
	r.Publish(rows...)
	require.Equal(t, 2, outboxRows(t, pool, "true"))

	startRelay(t, outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: 5 * time.Millisecond})
	require.Eventually(t, func() bool { return outboxRows(t, pool, "true") == 0 }, 10*time.Second, 5*time.Millisecond)
	require.EqualValues(t, 2, streamMsgs(t, stream))
}
