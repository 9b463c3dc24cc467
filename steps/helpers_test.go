package steps_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newWorker(t testing.TB, pool *pgxpool.Pool, defs ...*saga.Definition) *steps.Worker {
	t.Helper()
	w, err := steps.New(steps.Config{Pool: pool, SubjectPrefix: "t", Definitions: defs, Logger: quiet()})
	require.NoError(t, err)
	return w
}

// meteredWorker returns a worker for def on pool with metrics of its own,
// its Config set by change.
func meteredWorker(t testing.TB, pool *pgxpool.Pool, def *saga.Definition, change func(*steps.Config)) (*steps.Worker, *metrics.Metrics) {
	t.Helper()
	var err error
	cfg := steps.Config{Pool: pool, SubjectPrefix: "t", Definitions: []*saga.Definition{def}, Logger: quiet()}
	change(&cfg)
	w, err := steps.New(cfg)
	require.NoError(t, err)
	return w, w.Metrics()
}

// effectsDB returns a test database with a table for handlers' effects.
func effectsDB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return testenv.DB(t)
}

// writeEffect is a handler's business write: a row in effects.
func writeEffect(ctx context.Context, sc *saga.StepContext) error {
	_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, $2)`, sc.SagaID, sc.Step)
	return err
}

func countEffects(t testing.TB, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from effects`).Scan(&n))
	return n
}

// tracedEffectsDB returns a pool of one connection to a fresh effectsDB,
// what counts its round trips, and the shared pool of the database.
func tracedEffectsDB(t *testing.T) (*pgxpool.Pool, *testenv.RoundTrips, *pgxpool.Pool) {
	t.Helper()
	trips := &testenv.RoundTrips{}
	shared := effectsDB(t)
	return poolWith(t, shared, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = trips }), trips, shared
}

// requireNoOpenTransaction fails the test if a session on pool's database
// sits idle inside a transaction.
func requireNoOpenTransaction(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var idle int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from pg_stat_activity where datname = current_database() and state like 'idle in transaction%'`).Scan(&idle))
	require.Zero(t, idle, "no transaction left open")
}

// poolWith returns a pool of one connection to shared's database, set by
// change.
func poolWith(t testing.TB, shared *pgxpool.Pool, change func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg := shared.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	change(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// handleAtOnce delivers cmd to w from n goroutines released together, half
// of them as redeliveries, and returns their replies, each without error.
func handleAtOnce(t *testing.T, w *steps.Worker, cmd wire.Command, n int) []wire.Reply {
	t.Helper()
	replies := make([]wire.Reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			if i%2 == 1 {
				replies[i], errs[i] = w.HandleRedelivered(context.Background(), cmd)
			} else {
				replies[i], errs[i] = w.Handle(context.Background(), cmd)
			}
		})
	}
	close(gate)
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	return replies
}

func counter(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}

// inbox reads what the inbox holds for a key.
func inbox(t testing.TB, pool *pgxpool.Pool, sagaID, key uuid.UUID) (outcome string, attempt int, unknown bool) {
	t.Helper()
	require.NoError(t, pool.QueryRow(context.Background(), `select outcome::text, attempt, unknown from idemsaga.inbox where saga_id = $1 and step_key = $2`,
		pguuid.Of(sagaID), pguuid.Of(key)).Scan(&outcome, &attempt, &unknown))
	return outcome, attempt, unknown
}
