package engine_test

import (
	"context"
	"testing"

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
	pool, counted := testenv.CountRoundTrips(t, shared)
	e := idleEngine(t, pool, nc, testenv.Name("REAP"), prometheus.NewRegistry(), transferDef(t))
	require.NoError(t, pool.Ping(ctx)) // a connection made before counting

	counted.Reset()
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, moved)
	require.Equal(t, []int32{1, 0}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone")
}
