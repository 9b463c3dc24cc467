package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestBrokerRestartLosingEverything replaces the NATS server mid-run with a
// new one that has no stream, no consumers and no messages. The engine
// recreates what it needs, and leases re-drive every step the broker lost:
// all sagas finish and money is conserved.
func TestBrokerRestartLosingEverything(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	srv, nc := testenv.NATS(t)
	policy := fastPolicy
	policy.Timeout = time.Second
	def, err := fixture.Transfer(policy)
	require.NoError(t, err)
	seeded := seedForLoad(t, pool)
	stream := testenv.Name("RESTART")
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
		c.LeaseGrace = time.Second
	})

	// Started from a client without step workers: the first commands are
	// in the stream when the broker loses everything.
	credited, compensated := submitTransfers(t, def, 100, brokerClient(t, pool, stream, def))
	addr := srv.Addr().String()
	srv.Shutdown()
	srv.WaitForShutdown()
	// Work continues against the database while the broker is gone.
	time.Sleep(300 * time.Millisecond)
	_ = testenv.StartNATSAt(t, t.TempDir(), addr)
	// The new server's cleanup runs before the engine's: stop the engine
	// first, or it recreates its stream on a server shutting down, whose
	// store then outlives it.
	defer func() { require.NoError(t, e.Stop(ctx)) }()

	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	var takeovers int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where attempt > 1`).Scan(&takeovers))
	t.Logf("steps re-dispatched after the broker lost them: %d", takeovers)
}
