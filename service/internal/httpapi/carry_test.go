package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/startlock"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// counterSum sums every series of the counter family name in reg.
func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, f := range families {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestStartCarriedOverHTTP: starts through the API of a process that runs
// the saga's steps commit with their first step, cross no broker, and
// still make one saga per key. 20 keys are each sent 3 times at once; a
// 409 is retried after its Retry-After until it gets the saga.
func TestStartCarriedOverHTTP(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	reg := prometheus.NewRegistry()
	eng, _ := runEngine(t, pool, "HTTPCARRY", []*saga.Definition{payout}, func(c *engine.Config) {
		c.Registerer = reg
		c.StepConcurrency = 64
	})
	e := serve(t, pool, eng.Client())

	const keys, copies = 20, 3
	bodies := make([][]string, keys)
	created := make([]int, keys)
	var mu sync.Mutex
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for k := range keys {
		for range copies {
			wg.Go(func() {
				<-gate
				key := "carried-" + string(rune('a'+k))
				for {
					r, err := e.send(http.MethodPost, "/v1/sagas/payout", startHeaders(key), `{"account":5,"amount":`+string(rune('1'+k%9))+`}`)
					if !assertNoError(t, err) {
						return
					}
					if r.status == http.StatusConflict {
						require.Equal(t, httpapi.ProblemInFlight, r.problem(t).Type)
						time.Sleep(50 * time.Millisecond)
						continue
					}
					mu.Lock()
					defer mu.Unlock()
					bodies[k] = append(bodies[k], string(r.body))
					switch r.status {
					case http.StatusCreated:
						created[k]++
					case http.StatusOK:
						require.Equal(t, "true", r.header.Get(httpapi.ReplayedHeader))
					default:
						t.Errorf("key %s: answer %d: %s", key, r.status, r.body)
					}
					return
				}
			})
		}
	}
	close(gate)
	wg.Wait()
	for k := range keys {
		require.Equal(t, 1, created[k], "key %d made one saga", k)
		require.Len(t, bodies[k], copies)
		for _, b := range bodies[k] {
			require.Equal(t, bodies[k][0], b, "every answer of a key names its one saga")
			var s httpapi.Started
			require.NoError(t, json.Unmarshal([]byte(b), &s))
			require.Equal(t, saga.StateInit, s.State)
		}
	}
	require.Eventually(t, func() bool {
		return e.count(t, `select count(*) from idemsaga.sagas where state = 'booked'`) == keys
	}, time.Minute, 20*time.Millisecond)
	require.Equal(t, keys, e.sagaCount(t))
	require.Equal(t, keys, e.count(t, testenv.CarriedSQL), "every start committed with its first step")
	require.Equal(t, 2*keys, e.count(t, `select count(*) from httpapi_test.ledger where phase = 'forward'`), "each step booked once")
	require.Equal(t, keys, e.count(t, `select count(distinct (saga_id, step)) from httpapi_test.ledger where step = 'reserve'`))
	require.Zero(t, counterSum(t, reg, "idemsaga_outbox_published_total"), "no message crossed the broker")
}

// assertNoError reports err as the test's failure from a goroutine.
func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// TestStartKeyHeldThroughCarriedStep: while a start's first step runs in
// its transaction, a second request with its key is answered 409 at once
// and writes nothing; once the step commits, it is answered 200 with the
// first's bytes, and the step ran once.
func TestStartKeyHeldThroughCarriedStep(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var runs sync.Map
	var marked atomic.Bool
	slow := saga.WithInput(saga.MustNew("slowpay",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Retry: fastPolicy, CompensateRetry: fastPolicy, Compensate: ledgerStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				n, _ := runs.LoadOrStore(sc.SagaID, new(atomic.Int32))
				n.(*atomic.Int32).Add(1)
				// A start the handler makes with its ctx tries no lock.
				marked.Store(startlock.Arg(ctx, "slowpay", "any") != nil)
				entered <- struct{}{}
				select {
				case <-release:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
				return ledgerStep(ctx, sc)
			}},
		saga.Step{Name: "book", Reaches: "booked", Kind: saga.DatabaseStep, Forward: ledgerStep, Compensate: ledgerStep, Retry: fastPolicy, CompensateRetry: fastPolicy},
	), payoutInput.validate)
	eng, _ := runEngine(t, pool, "HTTPHELD", []*saga.Definition{slow}, nil)
	e := serve(t, pool, eng.Client())

	first := make(chan response, 1)
	go func() {
		r, err := e.send(http.MethodPost, "/v1/sagas/slowpay", startHeaders("held-by-step"), `{"account":4,"amount":40}`)
		assertNoError(t, err)
		first <- r
	}()
	<-entered
	r := e.do(t, http.MethodPost, "/v1/sagas/slowpay", startHeaders("held-by-step"), `{"account":4,"amount":40}`)
	require.Equal(t, http.StatusConflict, r.status, "body: %s", r.body)
	require.Equal(t, "1", r.header.Get("Retry-After"))
	require.Equal(t, httpapi.ProblemInFlight, r.problem(t).Type)
	require.Zero(t, e.sagaCount(t), "nothing is visible before the carried step commits")

	close(release)
	a := <-first
	require.Equal(t, http.StatusCreated, a.status, "body: %s", a.body)
	s := started(t, a)
	r = e.do(t, http.MethodPost, "/v1/sagas/slowpay", startHeaders("held-by-step"), `{"account":4,"amount":40}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, string(a.body), string(r.body))

	wctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := e.client.Wait(wctx, s.ID)
	require.NoError(t, err)
	require.Equal(t, 1, e.count(t, testenv.CarriedSQL))
	n, ok := runs.Load(s.ID)
	require.True(t, ok)
	require.EqualValues(t, 1, n.(*atomic.Int32).Load(), "the first step ran once")
	require.False(t, marked.Load(), "the HTTP start's lock mark does not reach the step's handler")
	require.Equal(t, 1, e.count(t, `select count(*) from httpapi_test.ledger where step = 'reserve' and phase = 'forward'`))
}
