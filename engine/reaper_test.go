package engine_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
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

// TestReaperLeavesOtherDefinitionsAlone: a step of a definition this
// engine does not run, whose lease expired, is left to the workers that
// have its code: the pass neither fails nor touches it.
func TestReaperLeavesOtherDefinitionsAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("OTHERS")
	other := saga.MustNew("other", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl := brokerClient(t, pool, stream, other)
	res, err := cl.Start(ctx, other, "o-1", map[string]int{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 hour' where saga_id = $1`, res.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `delete from idemsaga.outbox`)
	require.NoError(t, err)

	e := startEngine(t, pool, nc, stream, []*saga.Definition{transferDef(t)})
	n, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	var attempt int
	require.NoError(t, pool.QueryRow(ctx, `select attempt from idemsaga.steps where saga_id = $1`, res.ID).Scan(&attempt))
	require.Equal(t, 1, attempt, "not taken over by an engine without its code")
}
