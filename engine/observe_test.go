package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// unlabelled reads a gauge without labels (-1 when absent).
func unlabelled(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}

// TestStreamBacklogMetrics: messages nobody takes from the stream show as
// its content, with the age of the oldest, which the outbox's metrics no
// longer see once they were published; commands waiting for a worker show
// as the queued backlog.
func TestStreamBacklogMetrics(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("BACKLOG")
	reg := prometheus.NewRegistry()
	startEngine(t, pool, nc, stream, []*saga.Definition{transferDef(t)}, func(c *engine.Config) { c.Registerer = reg })
	require.Zero(t, unlabelled(t, reg, "idemsaga_stream_messages"))
	require.Zero(t, unlabelled(t, reg, "idemsaga_stream_oldest_message_seconds"))
	require.Zero(t, unlabelled(t, reg, "idemsaga_stream_drain_seconds"), "registered, and nothing predicted while idle")

	// Three messages under the stream's subjects that no consumer takes.
	for range 3 {
		_, err := nc.Request("t."+stream+".elsewhere", []byte("x"), 5*time.Second)
		require.NoError(t, err)
	}
	require.Equal(t, 3.0, unlabelled(t, reg, "idemsaga_stream_messages"))
	require.Greater(t, unlabelled(t, reg, "idemsaga_stream_oldest_message_seconds"), 0.0)
	require.Zero(t, unlabelled(t, reg, "idemsaga_stream_queued_messages"), "no consumer of the engine's is behind")

	// Two commands for step workers held back.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.Stream(context.Background(), stream)
	require.NoError(t, err)
	_, err = s.PauseConsumer(context.Background(), stream+"_steps_transfer", time.Now().Add(time.Hour))
	require.NoError(t, err)
	for range 2 {
		_, err := js.Publish(context.Background(), "t."+stream+".cmd.transfer.held", []byte("x"))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return unlabelled(t, reg, "idemsaga_stream_queued_messages") == 2 }, 10*time.Second, 100*time.Millisecond)
	require.Equal(t, 5.0, unlabelled(t, reg, "idemsaga_stream_messages"))
	require.Greater(t, unlabelled(t, reg, "idemsaga_stream_oldest_queued_seconds"), 0.0)
}
