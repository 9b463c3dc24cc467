package engine_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

// trips counts what a pool sends to PostgreSQL: batches, and statements
// sent alone (each a round trip).
type trips struct{ batches, alone atomic.Int32 }

func (r *trips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.alone.Add(1)
	return ctx
}
func (r *trips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *trips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.batches.Add(1)
	return ctx
}
func (r *trips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *trips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// TestAnIdleReaperPassIsOneRoundTrip: an idle process makes a reaper pass
// every ReapInterval; one that finds nothing due costs a single round trip
// (it looks for due retries and expired leases together).
func TestAnIdleReaperPassIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	_, nc := testenv.NATS(t)
	counted := &trips{}
	cfg := shared.Config().Copy()
	cfg.ConnConfig.Tracer = counted
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	e := idleEngine(t, pool, nc, testenv.Name("REAP"), prometheus.NewRegistry(), transferDef(t))
	require.NoError(t, pool.Ping(ctx)) // a connection made before counting

	counted.batches.Store(0)
	counted.alone.Store(0)
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, moved)
	require.Equal(t, []int32{1, 0}, []int32{counted.batches.Load(), counted.alone.Load()}, "batches, statements alone")
}
