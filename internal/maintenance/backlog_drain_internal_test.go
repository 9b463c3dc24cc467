package maintenance

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

// feed gives m a reading a second from t0 on, one for each (queued,
// delivered) pair, and returns the time of the last.
func feed(m *drainMeter, t0 time.Time, readings ...[2]uint64) time.Time {
	at := t0
	for i, r := range readings {
		at = t0.Add(time.Duration(i) * time.Second)
		m.observe(meterReading{queued: r[0], delivered: r[1], at: at})
	}
	return at
}

// TestDrainPredictsFromBusySpansOnly: the pace that predicts a wait is
// measured only where the queue never ran dry. Idle seconds, and seconds
// in which the workers kept up with a queue of a few, predict nothing, so
// a burst after them is not judged by their pace; once 3 s of busy queue
// are measured, the wait is the queue over that pace.
func TestDrainPredictsFromBusySpansOnly(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	var m drainMeter
	// Idle, then keeping up: 150 a second delivered, 3 queued at each reading.
	feed(&m, t0, [2]uint64{0, 0}, [2]uint64{0, 0}, [2]uint64{3, 150}, [2]uint64{3, 300}, [2]uint64{3, 450})
	require.Zero(t, m.drain("c", 3), "workers keeping up measure no pace")
	require.Zero(t, m.drain("c", 10_000), "nor does a burst that arrives now")

	// A burst: the queue grows while the workers take 100 a second.
	t1 := t0.Add(5 * time.Second)
	feed(&m, t1, [2]uint64{2_000, 550}, [2]uint64{3_900, 650}, [2]uint64{5_800, 750})
	require.Zero(t, m.drain("c", 5_800), "2 s of busy queue measured: too little to refuse work on")
	at := feed(&m, t1.Add(3*time.Second), [2]uint64{7_700, 850})
	d := m.drain("c", 7_700)
	require.Equal(t, Drain{Consumer: "c", Queued: 7_700, Rate: 100, Measured: 3 * time.Second, Wait: 77 * time.Second}, d)

	// Spans older than the window fall out: 11 s later with no reading,
	// only the newest span (11 s long, in which the queue never ran dry)
	// counts.
	m.observe(meterReading{queued: 8_000, delivered: 850 + 1_100, at: at.Add(11 * time.Second)})
	d = m.drain("c", 8_000)
	require.Equal(t, 11*time.Second, d.Measured)
	require.InDelta(t, 100.0, d.Rate, 1e-9)

	// The consumer made again: its sequence starts over, and so does the pace.
	m.observe(meterReading{queued: 8_000, delivered: 10, at: at.Add(12 * time.Second)})
	require.Zero(t, m.drain("c", 8_000))
}

// TestDrainStalled: a queue the workers took nothing from over 3 s
// predicts no end.
func TestDrainStalled(t *testing.T) {
	t.Parallel()
	var m drainMeter
	feed(&m, time.Now(), [2]uint64{10, 4}, [2]uint64{10, 4}, [2]uint64{12, 4}, [2]uint64{12, 4})
	d := m.drain("c", 12)
	require.Equal(t, DrainStalled, d.Wait)
	require.Zero(t, d.Rate)
	require.Zero(t, m.drain("c", 0), "an empty queue waits for nothing")
}

// TestDrainNeverFromDrySpans is a property: readings in which the workers
// took at least what was queued at the last reading (the queue may have
// run dry) never predict a wait, whatever the arrivals; and a predicted
// pace lies between the slowest and the fastest busy span's.
func TestDrainNeverFromDrySpans(t *testing.T) {
	t.Parallel()
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 1))
		var dry, mixed drainMeter
		at := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
		var delivered, queued uint64
		var mdelivered, mqueued uint64
		lo, hi := -1.0, 0.0
		for range 30 {
			step := time.Duration(200+rng.IntN(2_000)) * time.Millisecond
			at = at.Add(step)
			delivered += queued + uint64(rng.IntN(50))
			queued = uint64(rng.IntN(1_000))
			dry.observe(meterReading{delivered: delivered, queued: queued, at: at})
			require.Zero(t, dry.drain("c", queued+1), "seed %d", seed)

			took := uint64(rng.IntN(int(mqueued) + 1))
			if mqueued > 0 && took < mqueued {
				rate := float64(took) / step.Seconds()
				if lo < 0 || rate < lo {
					lo = rate
				}
				hi = max(hi, rate)
			}
			mdelivered += took
			mqueued = mqueued - took + uint64(rng.IntN(300))
			mixed.observe(meterReading{delivered: mdelivered, queued: mqueued, at: at})
			if d := mixed.drain("c", mqueued); d.Measured > 0 {
				require.GreaterOrEqual(t, d.Rate, lo-1e-9, "seed %d", seed)
				require.LessOrEqual(t, d.Rate, hi+1e-9, "seed %d", seed)
			}
		}
	}
}

// TestBacklogDrainOnJetStream reads a real consumer's pace: nothing while
// no worker takes its queue but for less than 3 s, then a stall; then,
// with a worker taking a few messages between readings, a finite wait
// that is the queue over the pace, reported by the drain collector too.
func TestBacklogDrainOnJetStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, nc := testenv.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	name := testenv.Name("DRAIN")
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"d." + name + ".>"}, Retention: jetstream.WorkQueuePolicy})
	require.NoError(t, err)
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name + "_steps", FilterSubject: "d." + name + ".cmd.>",
		AckPolicy: jetstream.AckExplicitPolicy})
	require.NoError(t, err)
	sb := NewStreamBacklog(js, name, name+"_steps")
	for range 200 {
		_, err := js.PublishAsync("d."+name+".cmd.x", []byte("c"))
		require.NoError(t, err)
	}
	<-js.PublishAsyncComplete()
	// The server counts a consumer's pending messages a moment after it
	// stored them (a CI run read 0 of 200 right after the acks).
	require.Eventually(t, func() bool {
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 200
	}, 30*time.Second, 10*time.Millisecond, "the consumer counts the 200 messages")

	first, err := sb.read(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(200), first.Msgs)
	require.Zero(t, first.Drain, "the first reading of a queue predicts nothing")

	var b Backlog
	deadline := time.Now().Add(time.Minute)
	for b.Drain.Measured < drainMeasuredMin {
		require.True(t, time.Now().Before(deadline), "no pace measured within a minute")
		time.Sleep(200 * time.Millisecond)
		b, err = sb.read(ctx)
		require.NoError(t, err)
	}
	require.Equal(t, Drain{Consumer: name + "_steps", Queued: 200, Measured: b.Drain.Measured, Wait: DrainStalled}, b.Drain, "no worker took any")

	// A worker takes 2 messages between readings, until the zero spans
	// have left the window.
	taken := 0
	for b.Drain.Wait == DrainStalled || b.Drain.Measured < drainWindow-time.Second {
		require.True(t, time.Now().Before(deadline), "the pace did not follow the worker within a minute")
		batch, err := c.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		for m := range batch.Messages() {
			require.NoError(t, m.Ack())
			taken++
		}
		time.Sleep(200 * time.Millisecond)
		b, err = sb.read(ctx)
		require.NoError(t, err)
	}
	require.Equal(t, uint64(200-taken), b.Drain.Queued)
	require.Greater(t, b.Drain.Rate, 0.0)
	require.InDelta(t, float64(b.Drain.Queued)/b.Drain.Rate, b.Drain.Wait.Seconds(), 1e-6)

	// The collector reports the last reading's prediction.
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(NewDrainCollector(sb)))
	families, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, f := range families {
		got[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
	}
	b, _ = sb.Get(ctx)
	require.Equal(t, b.Drain.Wait.Seconds(), got["idemsaga_stream_drain_seconds"])
	require.Equal(t, b.Drain.Rate, got["idemsaga_stream_drain_rate"])
}
