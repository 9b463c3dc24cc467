package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// provider is another system with a quota per account and per tenant: it
// counts the calls that run at once, and the most it saw.
type provider struct {
	mu               sync.Mutex
	running, peak    int
	tenants, peakFor map[string]int
	calls            int
}

func (p *provider) call(tenant string) func() {
	p.mu.Lock()
	p.calls++
	p.running++
	p.peak = max(p.peak, p.running)
	p.tenants[tenant]++
	p.peakFor[tenant] = max(p.peakFor[tenant], p.tenants[tenant])
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		p.running--
		p.tenants[tenant]--
		p.mu.Unlock()
	}
}

type tenantInput struct {
	Tenant string `json:"tenant"`
}

// TestLimitHoldsAcrossEngines: three engines on one database run one
// definition whose external step is limited to 3 calls at once and 1 per
// tenant. Sagas started at once never exceed either bound at the other
// system, every call runs at its first attempt (waiting spent none), and
// the engines counted their waits.
func TestLimitHoldsAcrossEngines(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("LIMITS")
	p := &provider{tenants: map[string]int{}, peakFor: map[string]int{}}
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def, err := saga.New("limited",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Retry: fastPolicy},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Retry: fastPolicy,
			Limit: saga.Limit{Name: "psp", Concurrency: 3, PerKey: 1, KeyFunc: func(sc *saga.StepContext) string {
				var in tenantInput
				_ = json.Unmarshal(sc.Input, &in)
				return in.Tenant
			}},
			Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, in tenantInput) (struct{}, error) {
				done := p.call(in.Tenant)
				defer done()
				time.Sleep(20 * time.Millisecond) // the call
				return struct{}{}, nil
			})})
	require.NoError(t, err)
	defs := []*saga.Definition{def}
	regs := make([]*prometheus.Registry, 3)
	var engines []*engine.Engine
	for i := range regs {
		regs[i] = prometheus.NewRegistry()
		engines = append(engines, startEngine(t, pool, nc, stream, defs, func(c *engine.Config) { c.Registerer = regs[i] }))
	}
	const sagas = 24
	var wg sync.WaitGroup
	for i := range sagas {
		wg.Go(func() {
			_, err := engines[i%3].Client().Start(context.Background(), def, fmt.Sprintf("lim-%02d", i), tenantInput{Tenant: fmt.Sprintf("t%d", i%4)})
			require.NoError(t, err)
		})
	}
	wg.Wait()
	waitAllFinished(t, pool, time.Minute)

	p.mu.Lock()
	defer p.mu.Unlock()
	require.Equal(t, sagas, p.calls, "one call per saga")
	require.LessOrEqual(t, p.peak, 3, "calls at once, across the engines")
	for tenant, n := range p.peakFor {
		require.LessOrEqual(t, n, 1, "calls at once for %s", tenant)
	}
	var done, firstAttempt int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) filter (where status = 'succeeded'), count(*) filter (where attempt = 1)
from idemsaga.steps where step = 'charge'`).Scan(&done, &firstAttempt))
	require.Equal(t, sagas, done)
	require.Equal(t, sagas, firstAttempt, "waiting for the limit spent no attempt")
	var waits float64
	for _, r := range regs {
		waits += metricSum(t, r, "idemsaga_limit_waits_total", nil)
	}
	require.Positive(t, waits, "24 sagas on 3 turns waited")
	// A call gives its hold back once its outcome is recorded: just after
	// the commit that may have finished its saga.
	require.Eventually(t, func() bool {
		var holds int
		require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.limit_holds`).Scan(&holds))
		return holds == 0
	}, 30*time.Second, 10*time.Millisecond, "every hold was given back")
}

// TestHeartbeatKeepsALongCall: a call that runs far past its step's
// Timeout, and heartbeats more often than that, is neither cut short nor
// taken over: one attempt, one call, no lease expired. The same call
// without heartbeats ends at its Timeout, its outcome unknown.
func TestHeartbeatKeepsALongCall(t *testing.T) {
	t.Parallel()
	for _, beats := range []bool{true, false} {
		t.Run(fmt.Sprintf("heartbeats=%v", beats), func(t *testing.T) {
			t.Parallel()
			pool := testenv.DB(t)
			_, nc := testenv.NATS(t)
			var mu sync.Mutex
			calls, cut := 0, 0
			policy := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond, Timeout: time.Second}
			def, err := saga.New("long",
				saga.Step{Name: "report", Reaches: "reported", Kind: saga.ExternalStep, Retry: policy,
					Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
						mu.Lock()
						calls++
						mu.Unlock()
						// A job at the other system that takes 4 timeouts,
						// polled every tenth of one.
						for range 40 {
							select {
							case <-ctx.Done():
								mu.Lock()
								cut++
								mu.Unlock()
								return nil, ctx.Err()
							case <-time.After(100 * time.Millisecond):
							}
							if beats {
								if err := sc.Heartbeat(ctx); err != nil {
									return nil, err
								}
							}
						}
						return json.RawMessage(`{"pages":40}`), nil
					}})
			require.NoError(t, err)
			reg := prometheus.NewRegistry()
			e := startEngine(t, pool, nc, testenv.Name("LONG"), []*saga.Definition{def}, func(c *engine.Config) {
				c.Registerer = reg
				c.LeaseGrace = 500 * time.Millisecond
			})
			res, err := e.Client().Start(context.Background(), def, "long-1", nil)
			require.NoError(t, err)
			waitAllFinished(t, pool, time.Minute)
			sg, err := e.Client().Get(context.Background(), res.ID)
			require.NoError(t, err)
			mu.Lock()
			defer mu.Unlock()
			if beats {
				require.Equal(t, saga.State("reported"), sg.State, sg.Error)
				require.Equal(t, 1, calls, "one call")
				require.Zero(t, cut)
				require.Zero(t, metricSum(t, reg, "idemsaga_lease_takeovers_total", nil), "no lease ran out")
				require.GreaterOrEqual(t, metricSum(t, reg, "idemsaga_lease_extensions_total", map[string]string{"reason": "heartbeat"}), 30.0)
				return
			}
			require.Equal(t, saga.StateParked, sg.State, "cut at its Timeout twice, possibly done, no compensation")
			require.Equal(t, 2, cut)
		})
	}
}

// TestHeartbeatOfALostAttempt: a heartbeat of an attempt whose step moved
// on (taken over, given up) says so with saga.ErrLeaseLost.
func TestHeartbeatOfALostAttempt(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	var id uuid.UUID
	lost := make(chan error, 1)
	def, err := saga.New("lost",
		saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep, Retry: saga.RetryPolicy{MaxAttempts: 1, Timeout: 10 * time.Second},
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				// Another process took the step over meanwhile.
				_, err := pool.Exec(ctx, `update idemsaga.steps set attempt = attempt + 1 where saga_id = $1 and step = 'call'`, sc.SagaID)
				if err != nil {
					return nil, err
				}
				err = sc.Heartbeat(ctx)
				lost <- err
				return nil, err
			}})
	require.NoError(t, err)
	e := startEngine(t, pool, nc, testenv.Name("LOST"), []*saga.Definition{def})
	res, err := e.Client().Start(context.Background(), def, "lost-1", nil)
	require.NoError(t, err)
	id = res.ID
	select {
	case err := <-lost:
		require.True(t, errors.Is(err, saga.ErrLeaseLost), "got %v", err)
		require.ErrorContains(t, err, id.String())
	case <-time.After(30 * time.Second):
		t.Fatal("the handler did not run")
	}
}
