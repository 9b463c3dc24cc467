package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// pledgeEnv serves the API of an engine running "pledge": a callback
// step, then a database step; tokens receives each request's callback
// token.
func pledgeEnv(t *testing.T) (*env, chan string) {
	t.Helper()
	return pledgeEnvWith(t, func(d *saga.Definition) *saga.Definition { return d })
}

// pledgeEnvWith is pledgeEnv with the definition changed by with.
func pledgeEnvWith(t *testing.T, with func(*saga.Definition) *saga.Definition) (*env, chan string) {
	t.Helper()
	tokens := make(chan string, 10)
	noop := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def := with(saga.MustNew("pledge",
		saga.Step{Name: "ask", Reaches: "asked", Kind: saga.CallbackStep, Retry: fastPolicy, CompensateRetry: fastPolicy, Compensate: noop,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				tokens <- sc.CallbackToken()
				return nil, nil
			}},
		saga.Step{Name: "thank", Reaches: "thanked", Kind: saga.DatabaseStep, Forward: noop, Retry: fastPolicy}))
	return engineEnvWith(t, def), tokens
}

func completed(t testing.TB, r response) httpapi.Completed {
	t.Helper()
	require.Equal(t, "application/json", r.header.Get("Content-Type"), "%d %s", r.status, r.body)
	var c httpapi.Completed
	require.NoError(t, json.Unmarshal(r.body, &c))
	return c
}

func TestCallbackOverHTTP(t *testing.T) {
	t.Parallel()
	e, tokens := pledgeEnv(t)
	r := e.do(t, http.MethodPost, "/v1/sagas/pledge", startHeaders("p-1"), `{}`)
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	id := started(t, r).ID
	var token string
	select {
	case token = <-tokens:
	case <-time.After(30 * time.Second):
		t.Fatal("no request sent")
	}
	require.Eventually(t, func() bool {
		return e.count(t, `select count(*) from idemsaga.steps where saga_id = $1 and step = 'ask' and status = 'waiting'`, id) == 1
	}, 30*time.Second, 5*time.Millisecond)

	// Ten deliveries of one event at once: one decides, all answer
	// applied, nine of them as replays.
	path := "/v1/callbacks/" + token
	const n = 10
	res := make([]response, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], errs[i] = e.send(http.MethodPost, path, []hdr{jsonType()}, `{"event_id":"evt-1","result":{"amount":10}}`)
		}()
	}
	wg.Wait()
	replayed := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, http.StatusOK, res[i].status, "%s", res[i].body)
		c := completed(t, res[i])
		require.Equal(t, engine.CallbackApplied, c.Outcome)
		require.Equal(t, id, c.SagaID)
		if res[i].header.Get(httpapi.ReplayedHeader) == "true" {
			replayed++
		}
	}
	require.Equal(t, n-1, replayed)
	require.Eventually(t, func() bool {
		return e.count(t, `select count(*) from idemsaga.sagas where id = $1 and state = 'thanked'`, id) == 1
	}, 30*time.Second, 5*time.Millisecond)

	// Refusals write nothing.
	before := e.count(t, `select count(*) from idemsaga.callbacks`)
	for _, tc := range []struct {
		path, body string
		headers    []hdr
		status     int
		typ        string
		detail     string
	}{
		{path, `{"event_id":"evt-1","result":{"amount":11}}`, []hdr{jsonType()}, http.StatusUnprocessableEntity, httpapi.ProblemCallbackReused, ""},
		{path, `{"event_id":"evt-2","Result":{}}`, []hdr{jsonType()}, http.StatusBadRequest, httpapi.ProblemMalformedRequest, `member "Result" is unknown`},
		{path, `{"event_id":"evt-2","event_id":"evt-3"}`, []hdr{jsonType()}, http.StatusBadRequest, httpapi.ProblemMalformedRequest, `member "event_id" appears twice`},
		{path, `{"result":{}}`, []hdr{jsonType()}, http.StatusBadRequest, httpapi.ProblemMalformedRequest, "no event id"},
		{path, `{"event_id":"evt-2","result":{},"error":"no"}`, []hdr{jsonType()}, http.StatusBadRequest, httpapi.ProblemMalformedRequest, ""},
		{path, `{"event_id":"evt-2"}`, nil, http.StatusUnsupportedMediaType, httpapi.ProblemUnsupportedMediaType, ""},
		{"/v1/callbacks/nope", `{"event_id":"evt-2"}`, []hdr{jsonType()}, http.StatusNotFound, httpapi.ProblemNotFound, ""},
		{"/v1/callbacks/" + saga.CallbackToken(id, "thank"), `{"event_id":"evt-2"}`, []hdr{jsonType()}, http.StatusUnprocessableEntity, httpapi.ProblemNotCallbackStep, ""},
		{"/v1/callbacks/" + saga.CallbackToken(id, "other"), `{"event_id":"evt-2"}`, []hdr{jsonType()}, http.StatusUnprocessableEntity, httpapi.ProblemNotCallbackStep, ""},
	} {
		r := e.do(t, http.MethodPost, tc.path, tc.headers, tc.body)
		require.Equal(t, tc.status, r.status, "%s %s: %s", tc.path, tc.body, r.body)
		p := r.problem(t)
		require.Equal(t, tc.typ, p.Type)
		require.Contains(t, p.Detail, tc.detail)
	}
	require.Equal(t, before, e.count(t, `select count(*) from idemsaga.callbacks`))

	// The saga shows its callback.
	r = e.do(t, http.MethodGet, "/v1/sagas/"+id.String(), nil, "")
	require.Equal(t, http.StatusOK, r.status)
	var shown httpapi.Saga
	require.NoError(t, json.Unmarshal(r.body, &shown))
	require.Len(t, shown.Callbacks, 1)
	require.Equal(t, "evt-1", shown.Callbacks[0].EventID)
	require.Equal(t, engine.CallbackApplied, shown.Callbacks[0].Outcome)
	require.JSONEq(t, `{"amount":10}`, string(shown.Callbacks[0].Result))
	require.Equal(t, 1, shown.DefinitionVersion)
	for _, st := range shown.Steps {
		if st.Step == "ask" && st.Phase == saga.PhaseForward {
			require.NotNil(t, st.CallbackToken)
			require.Equal(t, token, *st.CallbackToken)
		}
	}

	// Another event for the finished saga: recorded as late, 200.
	r = e.do(t, http.MethodPost, path, []hdr{jsonType()}, `{"event_id":"evt-9","result":{"amount":10}}`)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, engine.CallbackLate, completed(t, r).Outcome)
}

// TestSignedCallbacks: a definition that signs its callbacks takes only
// a callback signed, over the body as delivered, with one of its secrets
// (the old or the new one while they rotate); a missing, wrong or stale
// signature is refused with 401 before anything is written, and counted.
func TestSignedCallbacks(t *testing.T) {
	t.Parallel()
	oldSecret, newSecret := []byte("old-secret"), []byte("new-secret")
	e, tokens := pledgeEnvWith(t, func(d *saga.Definition) *saga.Definition { return saga.WithCallbackSecrets(d, oldSecret, newSecret) })
	r := e.do(t, http.MethodPost, "/v1/sagas/pledge", startHeaders("s-1"), `{}`)
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	id := started(t, r).ID
	var token string
	select {
	case token = <-tokens:
	case <-time.After(30 * time.Second):
		t.Fatal("no request sent")
	}
	require.Eventually(t, func() bool {
		return e.count(t, `select count(*) from idemsaga.steps where saga_id = $1 and step = 'ask' and status = 'waiting'`, id) == 1
	}, 30*time.Second, 5*time.Millisecond)

	path := "/v1/callbacks/" + token
	body := `{"event_id":"evt-1","result":{"amount":10}}`
	sig := func(secret []byte, b string) hdr {
		return hdr{saga.CallbackSignatureHeader, saga.SignCallback(secret, []byte(b))}
	}
	for _, tc := range []struct {
		name    string
		headers []hdr
		detail  string
	}{
		{"no signature", []hdr{jsonType()}, "send Idemsaga-Signature"},
		{"another secret", []hdr{jsonType(), sig([]byte("guess"), body)}, "matches none"},
		{"another body", []hdr{jsonType(), sig(newSecret, `{"event_id":"evt-1","result":{"amount":1000}}`)}, "matches none"},
		{"not a signature", []hdr{jsonType(), {saga.CallbackSignatureHeader, "sha256=zz"}}, "matches none"},
	} {
		r := e.do(t, http.MethodPost, path, tc.headers, body)
		require.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", tc.name, r.body)
		p := r.problem(t)
		require.Equal(t, httpapi.ProblemCallbackSignature, p.Type, tc.name)
		require.Contains(t, p.Detail, tc.detail, tc.name)
	}
	require.Zero(t, e.count(t, `select count(*) from idemsaga.callbacks`), "a refused callback writes nothing")
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.steps where saga_id = $1 and step = 'ask' and status = 'waiting'`, id))

	// Signed with either secret of the rotation: applied once.
	r = e.do(t, http.MethodPost, path, []hdr{jsonType(), sig(oldSecret, body)}, body)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, engine.CallbackApplied, completed(t, r).Outcome)
	r = e.do(t, http.MethodPost, path, []hdr{jsonType(), sig(newSecret, body)}, body)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	require.Equal(t, "true", r.header.Get(httpapi.ReplayedHeader))
	require.Eventually(t, func() bool {
		return e.count(t, `select count(*) from idemsaga.sagas where id = $1 and state = 'thanked'`, id) == 1
	}, 30*time.Second, 5*time.Millisecond)
}
