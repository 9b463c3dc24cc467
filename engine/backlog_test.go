package engine_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestShedStartsByTheWorkersPace runs the default shedding (no count
// bound, the lease grace as the bound on the wait) while the oldest queued
// command never gets near that age: whatever is shed is shed by the
// predicted wait. A burst after an idle spell is accepted whole, and so is
// a burst into a queue no worker takes from, for as long as no pace was
// measured; once the workers are seen taking none, every start of a
// concurrent burst is refused, counted, and writes nothing; once they take
// the queue again, starts are accepted.
func TestShedStartsByTheWorkersPace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seedForLoad(t, pool)
	stream := testenv.Name("SHEDPACE")
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
		// A shedding age of ten minutes: no command waits that long here.
		c.LeaseGrace, c.Registerer = 10*time.Minute, reg
	})
	cl := brokerClient(t, pool, stream, def)
	sagas := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas`).Scan(&n))
		return n
	}
	var next atomic.Int64
	// burst asks ShedStart for n starts at once and starts those it
	// accepts; it returns the refusals.
	burst := func(n int) []*engine.Overload {
		t.Helper()
		gate := make(chan struct{})
		var mu sync.Mutex
		var shed []*engine.Overload
		var wg sync.WaitGroup
		for range n {
			i := next.Add(1)
			wg.Go(func() {
				<-gate
				if err := e.ShedStart(ctx, def.Name()); err != nil {
					var o *engine.Overload
					require.True(t, errors.As(err, &o), "%v", err)
					mu.Lock()
					shed = append(shed, o)
					mu.Unlock()
					return
				}
				_, err := cl.Start(ctx, def, fmt.Sprintf("pace-%d", i), transferInput(1+i%50, 1+(i+1)%50, 1))
				require.NoError(t, err)
			})
		}
		close(gate)
		wg.Wait()
		return shed
	}
	shedTotal := func() float64 {
		return metricSum(t, reg, "idemsaga_starts_shed_total", map[string]string{"definition": def.Name()})
	}
	queued := func() float64 { return metricSum(t, reg, "idemsaga_stream_queued_messages", nil) }

	// Idle, then a burst while the workers run: nothing shed.
	require.NoError(t, e.ShedStart(ctx, "probe"))
	require.Empty(t, burst(300))
	waitAllFinished(t, pool, time.Minute)

	// The workers hold back: a burst fills a queue no worker takes from.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	_, err = s.PauseConsumer(ctx, stream+"_steps_"+def.Name(), time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.Empty(t, burst(100))
	require.Eventually(t, func() bool { return queued() >= 100 }, time.Minute, 50*time.Millisecond, "the burst's commands queue")
	require.NoError(t, e.ShedStart(ctx, "probe"), "a queue first seen has no measured pace: nothing is predicted, nothing shed")

	var stalled *engine.Overload
	require.Eventually(t, func() bool { return errors.As(e.ShedStart(ctx, "probe"), &stalled) }, time.Minute, 50*time.Millisecond,
		"a queue no worker takes from sheds once measured")
	require.Equal(t, engine.DrainStalled, stalled.Drain)
	require.Contains(t, stalled.Reason, "the workers took none of the")
	require.Less(t, stalled.OldestAge, 10*time.Minute, "the age rule is not what shed")
	require.Zero(t, shedTotal())
	before := sagas()
	shed := burst(50)
	require.Len(t, shed, 50, "every start of the burst is shed")
	for _, o := range shed {
		require.Equal(t, engine.DrainStalled, o.Drain)
		require.GreaterOrEqual(t, o.RetryAfter, time.Second)
	}
	require.Equal(t, float64(50), shedTotal(), "each shed start counted once")
	require.Equal(t, before, sagas(), "a shed start writes nothing")

	// The workers take the queue again: starts are accepted.
	_, err = s.ResumeConsumer(ctx, stream+"_steps_"+def.Name())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.ShedStart(ctx, "probe") == nil }, time.Minute, 50*time.Millisecond)
	require.Empty(t, burst(50))
	waitAllFinished(t, pool, time.Minute)
	require.Equal(t, 450, sagas())
	require.Equal(t, float64(50), shedTotal())
}
