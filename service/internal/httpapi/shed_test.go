package httpapi_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
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
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestStartsShedAboveTheBacklog fills the engine's stream past its
// shedding bound with commands no worker is given (the step consumer is
// paused): many concurrent starts
// (one of them with a submit token) all get 503 with a Retry-After and
// nothing is written. Once the stream is purged, the same requests start
// their sagas.
func TestStartsShedAboveTheBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	reg := prometheus.NewRegistry()
	e, cfg := runEngine(t, pool, "SHED", []*saga.Definition{payout}, func(c *engine.Config) {
		c.ShedStreamMessages, c.Registerer = 5, reg
	})
	nc, stream, prefix := cfg.NATS, cfg.Stream, cfg.SubjectPrefix
	env := serve(t, pool, e.Client(), func(c *httpapi.Config) { c.ShedFunc = e.ShedStart })
	tok := env.issued(t, "payout")

	// Commands queued for step workers that are held back: a backlog.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	_, err = s.PauseConsumer(ctx, stream+"_steps_payout", time.Now().Add(time.Hour))
	require.NoError(t, err)
	for i := range 10 {
		_, err := js.Publish(ctx, prefix+".cmd.payout.backlog", []byte(strconv.Itoa(i)))
		require.NoError(t, err)
	}
	waitShed := func(want bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for (e.ShedStart(ctx, "probe") != nil) != want {
			require.True(t, time.Now().Before(deadline), "shedding did not become %v within 10s", want)
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitShed(true)

	const n = 40
	keyOf := func(i int) string {
		if i == 0 {
			return tok.Token
		}
		return fmt.Sprintf("shed-%d", i)
	}
	startAll := func() []response {
		out := make([]response, n)
		errs := make([]error, n)
		gate := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-gate
				out[i], errs[i] = env.send(http.MethodPost, "/v1/sagas/payout", startHeaders(keyOf(i)), `{"account":1,"amount":5}`)
			})
		}
		close(gate)
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		return out
	}

	for i, r := range startAll() {
		require.Equal(t, http.StatusServiceUnavailable, r.status, "request %d: %s", i, r.body)
		p := r.problem(t)
		require.Equal(t, httpapi.ProblemOverloaded, p.Type)
		require.Contains(t, p.Detail, "nothing was written")
		require.Contains(t, p.Detail, "more than 5 messages wait for a worker")
		after, err := strconv.Atoi(r.header.Get("Retry-After"))
		require.NoError(t, err, "Retry-After is whole seconds")
		require.GreaterOrEqual(t, after, 1)
	}
	env.nothingWritten(t)
	require.Zero(t, tokenCount(t, pool, `consumed_at is not null`), "the submit token stays unused")
	require.Equal(t, float64(n), shedCount(t, reg, "payout"), "every shed start counted")

	require.NoError(t, s.Purge(ctx))
	_, err = s.ResumeConsumer(ctx, stream+"_steps_payout")
	require.NoError(t, err)
	waitShed(false)
	for i, r := range startAll() {
		require.Equal(t, http.StatusCreated, r.status, "request %d: %s", i, r.body)
	}
	require.Equal(t, n, env.sagaCount(t))
	require.Equal(t, 1, tokenCount(t, pool, `consumed_at is not null`), "the token started its saga once accepted")
}

// shedCount reads the shed counter of definition.
func shedCount(t *testing.T, reg *prometheus.Registry, definition string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != "idemsaga_starts_shed_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "definition" && l.GetValue() == definition {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestShedStillReplaysAStartedKey: while starts are shed, a request whose
// key started its saga already is answered as any replay (200, the same
// body), concurrently (a request that meets another in flight gets the
// usual 409 and, sent again, the replay); only a new key gets the 503,
// and it writes nothing; invalid input still gets its 400.
func TestShedStillReplaysAStartedKey(t *testing.T) {
	t.Parallel()
	var shedding atomic.Bool
	env := newEnv(t, func(c *httpapi.Config) {
		c.ShedFunc = func(context.Context, string) error {
			if shedding.Load() {
				return &engine.Overload{Reason: "test", RetryAfter: time.Second}
			}
			return nil
		}
	})
	first := env.start(t, "replay-1", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status, first.body)
	shedding.Store(true)

	const n = 10
	out := make([]response, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			for range 50 {
				out[i], errs[i] = env.send(http.MethodPost, "/v1/sagas/payout", startHeaders("replay-1"), `{"account":1,"amount":5}`)
				if errs[i] != nil || out[i].status != http.StatusConflict {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, http.StatusOK, out[i].status, "replay %d: %s", i, out[i].body)
		require.Equal(t, "true", out[i].header.Get(httpapi.ReplayedHeader))
		require.Equal(t, started(t, first).ID, started(t, out[i]).ID)
	}
	fresh := env.start(t, "replay-2", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusServiceUnavailable, fresh.status, fresh.body)
	bad := env.start(t, "replay-3", `{"account":1,"amount":"five"}`)
	require.Equal(t, http.StatusBadRequest, bad.status, "invalid input is refused as such under shedding too: %s", bad.body)
	require.Equal(t, 1, env.sagaCount(t), "the shed start wrote nothing")
}
