package engine_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// fastPolicy keeps retries quick in tests.
var fastPolicy = saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Timeout: 10 * time.Second}

func transferDef(t testing.TB) *saga.Definition {
	d, err := fixture.Transfer(fastPolicy)
	require.NoError(t, err)
	return d
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

type engineOpt func(*engine.Config)

func startEngine(t testing.TB, pool *pgxpool.Pool, nc *nats.Conn, stream string, defs []*saga.Definition, opts ...engineOpt) *engine.Engine {
	t.Helper()
	return startEngineCtx(t, context.Background(), pool, nc, stream, defs, opts...)
}

// startEngineCtx is startEngine started with ctx (its test hooks).
func startEngineCtx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, nc *nats.Conn, stream string, defs []*saga.Definition, opts ...engineOpt) *engine.Engine {
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
	// Tests set up sagas by hand with other clients first (short leases,
	// say); the engine declares the deployment as `migrate` would.
	require.NoError(t, engine.Deploy(ctx, cfg))
	require.NoError(t, e.Start(ctx))
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

func transferInput(from, to, amount int64) fixture.Input {
	return fixture.Input{From: from, To: to, Amount: amount}
}

func key(i int) string { return fmt.Sprintf("tr-%05d", i) }

// brokerClient returns a client without step workers of its own, as in a
// process that only starts sagas: the first command of each saga it
// starts crosses the broker (a relay publishes it), where an engine's own
// client would run it in the engine's process.
func brokerClient(t testing.TB, pool *pgxpool.Pool, stream string, defs ...*saga.Definition) *engine.Client {
	t.Helper()
	// Configured like the deployment's engines (startEngine's grace, or
	// the one a test gave them).
	grace := 10 * time.Second
	var recorded string
	if err := pool.QueryRow(context.Background(), `select value from idemsaga.settings where name = 'lease_grace'`).Scan(&recorded); err == nil {
		grace, err = time.ParseDuration(recorded)
		require.NoError(t, err)
	}
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: defs, Stream: stream, SubjectPrefix: "t." + stream, LeaseGrace: grace, Logger: quietLogger()})
	require.NoError(t, err)
	return cl
}

// replyWorker is a stand-alone step worker (outcomes answered by replies
// in the outbox, not applied in the step's transaction), for tests that
// drive commands and replies by hand.
type replyWorker struct{ r *attempt.Runner }

func newReplyWorker(t testing.TB, pool *pgxpool.Pool, prefix string, recent int, defs ...*saga.Definition) replyWorker {
	t.Helper()
	m, err := metrics.New(nil)
	require.NoError(t, err)
	r, err := attempt.New(attempt.Config{Pool: pool, Definitions: defs, Subjects: wire.Subjects{Prefix: prefix}, Logger: quietLogger(), Metrics: m, Recent: recent})
	require.NoError(t, err)
	return replyWorker{r}
}

func (w replyWorker) Handle(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.r.Handle(ctx, cmd, false)
}

// waitState waits up to 30 s for saga id to end, requires it ended in
// want, and returns it.
func waitState(t testing.TB, cl *engine.Client, id uuid.UUID, want saga.State) *saga.Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sg, err := cl.Wait(ctx, id)
	require.NoError(t, err)
	require.Equal(t, want, sg.State)
	return sg
}

// startAlone starts a saga in a transaction of its own (StartTx), which
// never runs its first step: the saga is there, for a pause or a look,
// while that step runs, where Start would commit it with the step's
// outcome.
func startAlone(t testing.TB, pool *pgxpool.Pool, cl *engine.Client, def *saga.Definition, key string, input any) (engine.StartResult, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	res, err := cl.StartTx(ctx, tx, def, key, input)
	if err != nil {
		return res, err
	}
	return res, tx.Commit(ctx)
}
