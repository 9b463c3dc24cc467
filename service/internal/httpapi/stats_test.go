package httpapi_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// statsEnv serves the API of a running engine of payout whose metrics
// GET /v1/stats reads.
func statsEnv(t *testing.T) *env {
	t.Helper()
	pool := testenv.DB(t)
	reg := prometheus.NewRegistry()
	e, _ := runEngine(t, pool, "STATS", []*saga.Definition{payout}, func(c *engine.Config) { c.Registerer = reg })
	return serve(t, pool, e.Client(), func(c *httpapi.Config) { c.Gatherer = reg })
}

func (e *env) stats(t *testing.T) httpapi.Stats {
	t.Helper()
	r := e.do(t, http.MethodGet, "/v1/stats", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	require.Equal(t, "no-store", r.header.Get("Cache-Control"))
	var s httpapi.Stats
	require.NoError(t, json.Unmarshal(r.body, &s))
	return s
}

// TestStats: the counters follow what the engine did (starts, replays,
// finished sagas, attempts), the backlog gauges are read, and a second
// answer is later, so a client can compute rates.
func TestStats(t *testing.T) {
	t.Parallel()
	e := statsEnv(t)
	before := e.stats(t)
	require.Zero(t, before.SagasStarted)
	require.NotNil(t, before.StreamMessages, "the engine's stream exists once it started")
	require.NotNil(t, before.StreamOldestSeconds)
	require.NotNil(t, before.OutboxBacklogRows)
	require.NotNil(t, before.OutboxOldestSeconds)

	for i := range 3 {
		r := e.start(t, fmt.Sprintf("s-%d", i), fmt.Sprintf(`{"account":1,"amount":%d}`, i+1))
		require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	}
	replay := e.start(t, "s-0", `{"account":1,"amount":1}`)
	require.Equal(t, http.StatusOK, replay.status, "body: %s", replay.body)

	deadline := time.Now().Add(20 * time.Second)
	var s httpapi.Stats
	for {
		s = e.stats(t)
		if s.SagasFinished["completed"] == 3 {
			break
		}
		require.True(t, time.Now().Before(deadline), "3 sagas not counted finished within 20s: %+v", s)
		time.Sleep(20 * time.Millisecond)
	}
	require.EqualValues(t, 3, s.SagasStarted)
	require.EqualValues(t, 1, s.Duplicates["start"], "the replayed start is a duplicate absorbed at the start layer")
	require.EqualValues(t, 4, s.Deliveries["start"])
	require.EqualValues(t, 6, s.StepAttempts["succeeded"], "two steps per saga")
	require.Zero(t, s.LeaseTakeovers)
	require.True(t, s.At.After(before.At), "at %s, then %s", before.At, s.At)
}

// TestStatsWithoutGatherer: a server mounted without the engine's
// metrics says so, rather than answering zeros.
func TestStatsWithoutGatherer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.do(t, http.MethodGet, "/v1/stats", nil, "")
	require.Equal(t, http.StatusNotImplemented, r.status, "body: %s", r.body)
	p := r.problem(t)
	require.Equal(t, httpapi.ProblemStatsUnavailable, p.Type)
	require.Contains(t, p.Detail, "Gatherer")
}

// TestDefinitions lists the recorded definitions with their steps and
// every state a saga of them can be in.
func TestDefinitions(t *testing.T) {
	t.Parallel()
	e := newEngineEnv(t)
	r := e.do(t, http.MethodGet, "/v1/definitions", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	require.JSONEq(t, `{"definitions":[{"name":"payout","version":1,
"steps":[{"name":"reserve","reaches":"reserved","kind":"database","compensates":true},{"name":"book","reaches":"booked","kind":"database","compensates":true}],
"final_state":"booked",
"states":["init","reserved","booked","compensating","compensated","failed","parked","closed"],
"paused":null}]}`, string(r.body))

	empty := newEnv(t)
	r = empty.do(t, http.MethodGet, "/v1/definitions", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.JSONEq(t, `{"definitions":[]}`, string(r.body))
}

// TestReadsNeedToken: with tokens configured, the console's reads
// answer 401 and no data without one.
func TestReadsNeedToken(t *testing.T) {
	t.Parallel()
	tokens, err := httpapi.ParseTokens("console-test-token-0123456789")
	require.NoError(t, err)
	e := newEnv(t, func(c *httpapi.Config) { c.Tokens = tokens; c.Gatherer = prometheus.NewRegistry() })
	s := started(t, func() response {
		e.token = "console-test-token-0123456789"
		defer func() { e.token = "" }()
		return e.start(t, "t-1", `{"account":1,"amount":1}`)
	}())
	for _, path := range []string{"/v1/stats", "/v1/definitions", "/v1/sagas", "/v1/sagas/" + s.ID.String()} {
		r := e.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", path, r.body)
		require.Equal(t, httpapi.ProblemUnauthorized, r.problem(t).Type, path)
		require.NotContains(t, string(r.body), s.ID.String(), path)
	}
	e.token = "console-test-token-0123456789"
	r := e.do(t, http.MethodGet, "/v1/stats", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
}
