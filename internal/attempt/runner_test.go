package attempt_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// newRunner returns a runner of defs on pool that answers with replies
// (no Mover) and remembers recent answered attempts (0: none).
func newRunner(t testing.TB, pool *pgxpool.Pool, recent int, defs ...*saga.Definition) (*attempt.Runner, *metrics.Metrics) {
	t.Helper()
	m, err := metrics.New(nil)
	require.NoError(t, err)
	r, err := attempt.New(attempt.Config{
		Pool: pool, Subjects: wire.Subjects{Prefix: "t"}, Definitions: defs, Metrics: m, Recent: recent,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	return r, m
}

func counter(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}

// TestConcurrentDeliveriesTakeEffectOnce: sixteen deliveries of one
// attempt of a database step, at once, half as redeliveries, to a runner
// that remembers nothing: its write commits once, one delivery answers
// with it, and the inbox absorbs the others, which answer with the same
// outcome.
func TestConcurrentDeliveriesTakeEffectOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid not null, n int not null)`)
	require.NoError(t, err)
	var runs atomic.Int32
	def := saga.MustNew("once", saga.Step{
		Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			n := runs.Add(1)
			_, err := sc.Tx.Exec(ctx, `insert into effects values ($1, $2)`, sc.SagaID, n)
			return json.RawMessage(`{"written":true}`), err
		},
	})
	r, m := newRunner(t, pool, 0, def)
	cmd := testenv.Command(testenv.NewSaga(t, pool, "once"), "once", "write", saga.PhaseForward, 1, nil)

	const n = 16
	replies := make([]wire.Reply, n)
	errs := make([]error, n)
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-gate
			replies[i], errs[i] = r.Handle(ctx, cmd, i%2 == 1)
		})
	}
	close(gate)
	wg.Wait()
	fresh := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, wire.OutcomeSucceeded, replies[i].Outcome)
		require.JSONEq(t, `{"written":true}`, string(replies[i].Result))
		if !replies[i].Duplicate {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one delivery answers with the run that committed")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects`).Scan(&effects))
	require.Equal(t, 1, effects, "the step's write committed once")
	require.Equal(t, int32(1), runs.Load(), "and its handler ran once: the others waited on the key")
	require.Equal(t, float64(n-1), counter(t, m.Duplicates.WithLabelValues(metrics.LayerInbox)))
	require.Zero(t, r.InHand())
}
