package limit_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/limit"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func newMetrics(t *testing.T) *metrics.Metrics {
	t.Helper()
	m, err := metrics.New(prometheus.NewRegistry())
	require.NoError(t, err)
	return m
}

func attempt(key string) limit.Attempt {
	return limit.Attempt{Key: key, Hold: time.Minute, Every: 50 * time.Millisecond}
}

// TestConcurrencyHoldsAcrossGates: callers of several gates (processes)
// on one database, all at once, never hold more turns than the limit's
// bound, nor more for one key than its per-key bound; every caller gets
// its turn, and the waits are counted.
func TestConcurrencyHoldsAcrossGates(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	m := newMetrics(t)
	gates := []*limit.Gate{limit.New(pool, nil, m), limit.New(pool, nil, m), limit.New(pool, nil, m)}
	l := saga.Limit{Name: "provider", Concurrency: 4, PerKey: 2}
	var running, peak atomic.Int64
	var mu sync.Mutex
	perKey, peakKey := map[string]int{}, map[string]int{}
	const callers = 40
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for i := range callers {
		wg.Go(func() {
			key := fmt.Sprintf("tenant-%d", i%3)
			turn, err := gates[i%len(gates)].Wait(context.Background(), l, attempt(key))
			if err != nil {
				errs <- err
				return
			}
			n := running.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			mu.Lock()
			perKey[key]++
			peakKey[key] = max(peakKey[key], perKey[key])
			mu.Unlock()
			time.Sleep(5 * time.Millisecond) // the call
			mu.Lock()
			perKey[key]--
			mu.Unlock()
			running.Add(-1)
			turn.Release(context.Background())
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.LessOrEqual(t, peak.Load(), int64(l.Concurrency), "turns at once")
	for key, p := range peakKey {
		require.LessOrEqual(t, p, l.PerKey, "turns at once for %s", key)
	}
	require.Positive(t, counter(t, m.LimitWaits.WithLabelValues("provider", "concurrency"))+
		counter(t, m.LimitWaits.WithLabelValues("provider", "per_key")), "40 callers on 4 turns waited")
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.limit_holds`).Scan(&left))
	require.Zero(t, left, "every turn gave its holds back")
}

// TestLapsedHoldIsTakenOver: a hold whose process died lapses at its
// deadline, and the next caller takes it then; a hold that is pushed
// forward (Extend) does not lapse.
func TestLapsedHoldIsTakenOver(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	g := limit.New(pool, nil, newMetrics(t))
	l := saga.Limit{Name: "one", Concurrency: 1}
	dead := attempt("")
	dead.Hold = 300 * time.Millisecond
	_, err := g.Wait(context.Background(), l, dead) // never released: its process died
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = g.Wait(ctx, l, attempt(""))
	require.ErrorIs(t, err, context.DeadlineExceeded, "the live hold is not taken")

	next, err := g.Wait(context.Background(), l, attempt(""))
	require.NoError(t, err, "taken once the dead one lapsed")
	require.NoError(t, next.Extend(context.Background()))
	var until time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `select until from idemsaga.limit_holds where name = 'one'`).Scan(&until))
	require.WithinDuration(t, time.Now().Add(time.Minute), until, 10*time.Second, "pushed to its hold from now")
	next.Release(context.Background())
}

// TestWaitKeepsTheLease: while a turn waits, it calls Keep; Keep's error
// (the attempt lost its step) ends the wait with it, and what the turn
// took is given back.
func TestWaitKeepsTheLease(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	g := limit.New(pool, nil, newMetrics(t))
	l := saga.Limit{Name: "busy", Concurrency: 1, PerKey: 1, KeyFunc: func(*saga.StepContext) string { return "" }}
	first, err := g.Wait(context.Background(), l, attempt("k"))
	require.NoError(t, err)
	defer first.Release(context.Background())

	var kept atomic.Int64
	lost := errors.New("lost its step")
	w := attempt("other")
	w.Keep = func(context.Context) error {
		if kept.Add(1) == 3 {
			return lost
		}
		return nil
	}
	_, err = g.Wait(context.Background(), l, w)
	require.ErrorIs(t, err, lost)
	require.EqualValues(t, 3, kept.Load())
	var holds int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.limit_holds where scope = 'other'`).Scan(&holds))
	require.Zero(t, holds, "the per-key hold it took is given back")
}

// TestRateSpacesStarts: starts under a rate, reserved by several gates at
// once, are spaced by the rate's spacing on the database's schedule, so
// n starts span at least n-1 spacings.
func TestRateSpacesStarts(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	m := newMetrics(t)
	gates := []*limit.Gate{limit.New(pool, nil, m), limit.New(pool, nil, m)}
	l := saga.Limit{Name: "paced", Rate: 50, Per: time.Second}
	const calls = 20
	starts := make([]time.Time, calls)
	var wg sync.WaitGroup
	begin := time.Now()
	for i := range calls {
		wg.Go(func() {
			turn, err := gates[i%2].Wait(context.Background(), l, attempt(""))
			if err == nil {
				starts[i] = time.Now()
				turn.Release(context.Background())
			}
		})
	}
	wg.Wait()
	var last time.Time
	for _, s := range starts {
		require.False(t, s.IsZero(), "every call got its start")
		last = maxTime(last, s)
	}
	require.GreaterOrEqual(t, last.Sub(begin), time.Duration(calls-1)*l.Spacing()-10*time.Millisecond,
		"20 starts at 50 per second span at least 19 spacings")
	require.Positive(t, counter(t, m.LimitWaits.WithLabelValues("paced", "rate")), "starts reserved ahead waited for them")
}

func counter(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// TestCheckRefusesOneNameWithTwoBounds: steps that share a limit's name
// must give it the same bounds.
func TestCheckRefusesOneNameWithTwoBounds(t *testing.T) {
	t.Parallel()
	step := func(name string, l saga.Limit) saga.Step {
		return saga.Step{Name: name, Reaches: saga.State(name + "d"), Kind: saga.ExternalStep, Limit: l,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}
	}
	a := saga.MustNew("a", step("charge", saga.Limit{Name: "psp", Rate: 10}))
	b := saga.MustNew("b", step("refund", saga.Limit{Name: "psp", Rate: 10}))
	c := saga.MustNew("c", step("refund", saga.Limit{Name: "psp", Rate: 20}))
	require.NoError(t, limit.Check([]*saga.Definition{a, b}))
	err := limit.Check([]*saga.Definition{a, c})
	require.ErrorContains(t, err, `limit "psp" has other bounds`)
}

// TestTwoTurnsOfOneAttemptTakeTwoHolds: two deliveries of one attempt
// take a turn each, with holds of their own: under a bound of one the
// second waits until the first gives its hold back, and the first's
// release leaves the second's hold in place.
func TestTwoTurnsOfOneAttemptTakeTwoHolds(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	g := limit.New(pool, nil, newMetrics(t))
	l := saga.Limit{Name: "solo", Concurrency: 1}
	first, err := g.Wait(context.Background(), l, attempt(""))
	require.NoError(t, err)
	second := make(chan *limit.Turn, 1)
	go func() {
		turn, err := g.Wait(context.Background(), l, attempt(""))
		assert.NoError(t, err)
		second <- turn
	}()
	select {
	case <-second:
		t.Fatal("the second delivery got a turn while the first held the only one")
	case <-time.After(200 * time.Millisecond):
	}
	first.Release(context.Background())
	turn := <-second
	var holds int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.limit_holds where name = 'solo'`).Scan(&holds))
	require.Equal(t, 1, holds, "the second's hold stands after the first's release")
	first.Release(context.Background()) // twice: nothing more
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.limit_holds where name = 'solo'`).Scan(&holds))
	require.Equal(t, 1, holds)
	turn.Release(context.Background())
}
