package engine_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

// TestAnIdleReaperPassIsOneRoundTrip: an idle process makes a reaper pass
// every ReapInterval; one that finds nothing due costs a single round trip
// (it looks for due retries and expired leases together).
func TestAnIdleReaperPassIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	_, nc := testenv.NATS(t)
	counted := &testenv.RoundTrips{}
	cfg := shared.Config().Copy()
	cfg.ConnConfig.Tracer = counted
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	e := idleEngine(t, pool, nc, testenv.Name("REAP"), prometheus.NewRegistry(), transferDef(t))
	require.NoError(t, pool.Ping(ctx)) // a connection made before counting

	counted.Reset()
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, moved)
	require.Equal(t, []int32{1, 0}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone")
}
