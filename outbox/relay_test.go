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
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/outbox"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// relayEnv gives a test its database, a NATS connection with JetStream,
// and a stream of its own capturing name.>.
func relayEnv(t *testing.T, prefix string) (*pgxpool.Pool, *nats.Conn, jetstream.JetStream, jetstream.Stream, string) {
	t.Helper()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	name := testenv.Name(prefix)
	stream, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}})
	require.NoError(t, err)
	return pool, nc, js, stream, name
}

// TestRelaysPublishEveryRowOnce runs three relays against writers whose
// transactions commit out of id order (some held open while later ids
// commit): every row is published, none twice into the stream.
func TestRelaysPublishEveryRowOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _, js, stream, name := relayEnv(t, "RELAY")

	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	var relays []*outbox.Relay
	for range 3 {
		r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, BatchSize: 17, PollInterval: 5 * time.Millisecond, Logger: log})
		require.NoError(t, err)
		require.NoError(t, r.Start(ctx))
		relays = append(relays, r)
	}
	t.Cleanup(func() {
		for _, r := range relays {
			require.NoError(t, r.Stop(context.Background()))
			require.NoError(t, r.Stop(context.Background()), "stop twice is fine")
		}
	})

	const writers, perWriter = 8, 60
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := 0; i < perWriter; i += 3 {
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				var msgs []outbox.Message
				for j := range 3 {
					id := fmt.Sprintf("w%d-%d", w, i+j)
					msgs = append(msgs, outbox.Message{Subject: name + ".x", MsgID: id, Payload: []byte(id), Headers: map[string]string{"X-Row": id}})
				}
				require.NoError(t, outbox.Write(ctx, tx, msgs...))
				if w%3 == 0 {
					time.Sleep(15 * time.Millisecond) // commit after later ids
				}
				require.NoError(t, tx.Commit(ctx))
				for _, r := range relays {
					r.Notify()
				}
			}
		})
	}
	wg.Wait()

	require.Eventually(t, func() bool {
		n, _, err := outbox.Backlog(ctx, pool, "")
		return err == nil && n == 0
	}, 30*time.Second, 10*time.Millisecond, "outbox drained")
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, writers*perWriter, info.State.Msgs, "each row is in the stream exactly once")

	// Every message id arrived, with its headers.
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	require.NoError(t, err)
	seen := map[string]bool{}
	batch, err := cons.Fetch(writers*perWriter, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	for m := range batch.Messages() {
		require.Equal(t, string(m.Data()), m.Headers().Get("X-Row"))
		seen[string(m.Data())] = true
	}
	require.Len(t, seen, writers*perWriter)
}

func TestWriteRejectsEmptySubject(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	require.ErrorContains(t, outbox.Write(ctx, tx, outbox.Message{MsgID: "x"}), "empty subject")
}

func TestNewRelayValidates(t *testing.T) {
	t.Parallel()
	_, err := outbox.NewRelay(outbox.RelayConfig{})
	require.ErrorContains(t, err, "Pool is required")
}

// TestRelaySkipsARowTheBrokerRefuses: a row over the broker's max payload
// is recorded as failing and does not hold back the rows after it.
func TestRelaySkipsARowTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, nc, js, stream, name := relayEnv(t, "POISON")

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	huge := make([]byte, nc.MaxPayload()+1)
	require.NoError(t, outbox.Write(ctx, tx,
		outbox.Message{Subject: name + ".x", MsgID: "huge", Payload: huge},
		outbox.Message{Subject: name + ".x", MsgID: "small-1", Payload: []byte("a")},
		outbox.Message{Subject: name + ".x", MsgID: "small-2", Payload: []byte("b")},
	))
	require.NoError(t, tx.Commit(ctx))

	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	n, err := r.RelayOnce(ctx)
	require.Error(t, err)
	require.Contains(t, err.Error(), "1 of 3 rows not published")
	require.Equal(t, 2, n)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, info.State.Msgs)

	var attempts int
	var lastErr string
	require.NoError(t, pool.QueryRow(ctx, `select attempts, last_error from idemsaga.outbox where msg_id = 'huge' and published_at is null`).Scan(&attempts, &lastErr))
	require.Equal(t, 1, attempts)
	require.Contains(t, lastErr, "maximum payload")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox`).Scan(&left))
	require.Equal(t, 1, left, "the published rows are deleted; the refused one stays")
}

// TestRelayKeepsPublishedRowsWhenAsked: with KeepPublished the relay marks
// rows instead of deleting them, and publishes each once.
func TestRelayKeepsPublishedRowsWhenAsked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _, js, _, name := relayEnv(t, "KEEP")
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, outbox.Write(ctx, tx,
		outbox.Message{Subject: name + ".x", MsgID: "a", Payload: []byte("a")},
		outbox.Message{Subject: name + ".x", MsgID: "b", Payload: []byte("b")}))
	require.NoError(t, tx.Commit(ctx))

	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, KeepPublished: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	n, err := r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	n, err = r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "a published row is not published again")
	var marked int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is not null`).Scan(&marked))
	require.Equal(t, 2, marked)
}

// TestAnIdleSweepIsOneRoundTrip: a sweep that finds nothing to publish
// (rows still in their writer's hand-off count as nothing) costs one
// round trip and opens no transaction; one that finds a row claims and
// publishes it.
func TestAnIdleSweepIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared, _, js, stream, name := relayEnv(t, "IDLE")
	pool, counted := testenv.CountRoundTrips(t, shared)
	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)

	// A row its writer still holds (hand-off not passed): nothing to do.
	b := &pgx.Batch{}
	require.NoError(t, outbox.QueueHandedOff(b, outbox.Message{Subject: name + ".x", MsgID: "held", Payload: []byte("a")}, time.Hour, func(outbox.Committed) {}))
	require.NoError(t, shared.SendBatch(ctx, b).Close())
	require.NoError(t, pool.Ping(ctx))
	counted.Reset()
	n, err := r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, []int32{0, 1}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone")

	// A row nobody publishes: the sweep takes it.
	tx, err := shared.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, outbox.Write(ctx, tx, outbox.Message{Subject: name + ".x", MsgID: "orphan", Payload: []byte("b")}))
	require.NoError(t, tx.Commit(ctx))
	n, err = r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, info.State.Msgs)
}
