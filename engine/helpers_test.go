package engine_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

// fastPolicy keeps retries quick in tests.
var fastPolicy = saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Timeout: 10 * time.Second}

func transferDef(t testing.TB) *saga.Definition {
	d, err := transfer.NewDefinition(fastPolicy)
	require.NoError(t, err)
	return d
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

type engineOpt func(*engine.Config)

func startEngine(t testing.TB, pool *pgxpool.Pool, nc *nats.Conn, stream string, defs []*saga.Definition, opts ...engineOpt) *engine.Engine {
	t.Helper()
	cfg := engine.Config{
		Pool: pool, NATS: nc, Definitions: defs, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, ReapInterval: 20 * time.Millisecond,
		RelayPollInterval: 20 * time.Millisecond, RelayHandOff: time.Second, Logger: quietLogger(),
	}
	for _, o := range opts {
		o(&cfg)
	}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, e.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(ctx))
	})
	return e
}

// waitAllFinished waits until every saga in the database is terminal.
func waitAllFinished(t testing.TB, pool *pgxpool.Pool, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var running int
		require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running))
		if running == 0 {
			return
		}
		if time.Now().After(deadline) {
			var sample string
			_ = pool.QueryRow(context.Background(), `select string_agg(id::text || ':' || state, ', ') from (select id, state from idemsaga.sagas where finished_at is null limit 5) x`).Scan(&sample)
			t.Fatalf("%d sagas still running after %s, e.g. %s", running, timeout, sample)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func transferInput(from, to, amount int64) transfer.Input {
	return transfer.Input{From: from, To: to, Amount: amount}
}

func key(i int) string { return fmt.Sprintf("tr-%05d", i) }

// brokerClient returns a client without step workers of its own, as in a
// process that only starts sagas: the first command of each saga it
// starts crosses the broker (a relay publishes it), where an engine's own
// client would run it in the engine's process.
func brokerClient(t testing.TB, pool *pgxpool.Pool, stream string, defs ...*saga.Definition) *engine.Client {
	t.Helper()
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: defs, Stream: stream, SubjectPrefix: "t." + stream, Logger: quietLogger()})
	require.NoError(t, err)
	return cl
}
