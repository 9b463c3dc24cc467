package httpapi_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestStartReplay starts a saga, replays the request (201 then 200 with
// the same bytes), and refuses the key with another input.
func TestStartReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	first := e.start(t, "T-1", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	require.Empty(t, first.header.Get(httpapi.ReplayedHeader))
	s := started(t, first)
	require.Equal(t, httpapi.Started{ID: s.ID, Definition: "payout", Key: "T-1", State: saga.StateInit}, s)
	require.Equal(t, "/v1/sagas/"+s.ID.String(), first.header.Get("Location"))
	require.Equal(t, fmt.Sprintf(`{"id":"%s","definition":"payout","key":"T-1","state":"init"}`+"\n", s.ID), string(first.body))

	// The same input in another spelling (order, whitespace) is the same.
	again := e.start(t, "T-1", "{ \"amount\": 5,\n \"account\": 1 }")
	require.Equal(t, http.StatusOK, again.status, "body: %s", again.body)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, first.body, again.body)
	require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))

	other := e.start(t, "T-1", `{"account":1,"amount":6}`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status)
	p := other.problem(t)
	require.Equal(t, httpapi.ProblemKeyReused, p.Type)
	require.Contains(t, p.Detail, s.ID.String())

	require.Equal(t, 1, e.sagaCount(t))
	var input string
	require.NoError(t, e.pool.QueryRow(context.Background(), `select input::text from idemsaga.sagas where id = $1`, s.ID).Scan(&input))
	require.JSONEq(t, `{"account":1,"amount":5}`, input)
}

// TestStartRefusals checks every refusal of a start, and that none of
// them writes anything.
func TestStartRefusals(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *httpapi.Config) { c.MaxBodyBytes = 64 })
	cases := []struct {
		name    string
		path    string
		headers []hdr
		body    string
		status  int
		typ     string
		detail  string
	}{
		{"smuggled case twin", "/v1/sagas/payout", startHeaders("k1"), `{"account":1,"amount":5,"AMOUNT":7000}`, 400, httpapi.ProblemInvalidInput, "AMOUNT"},
		{"smuggled duplicate", "/v1/sagas/payout", startHeaders("k2"), `{"account":1,"amount":5,"amount":7000}`, 400, httpapi.ProblemInvalidInput, "twice"},
		{"unknown member", "/v1/sagas/payout", startHeaders("k3"), `{"account":1,"amount":5,"memo":"x"}`, 400, httpapi.ProblemInvalidInput, "memo"},
		{"not JSON", "/v1/sagas/payout", startHeaders("k4"), `{"account":1,`, 400, httpapi.ProblemInvalidInput, "JSON"},
		{"empty body", "/v1/sagas/payout", startHeaders("k4b"), ``, 400, httpapi.ProblemInvalidInput, "JSON"},
		{"validator", "/v1/sagas/payout", startHeaders("k5"), `{"account":1,"amount":-5}`, 400, httpapi.ProblemInvalidInput, "amount must be positive"},
		{"missing member", "/v1/sagas/payout", startHeaders("k5b"), `{"amount":5}`, 400, httpapi.ProblemInvalidInput, "member /account is missing"},
		{"unknown definition", "/v1/sagas/nope", startHeaders("k6"), `{"account":1,"amount":5}`, 404, httpapi.ProblemUnknownDefinition, `"nope"`},
		{"no content type", "/v1/sagas/payout", []hdr{key("k7")}, `{"account":1,"amount":5}`, 415, httpapi.ProblemUnsupportedMediaType, "application/json"},
		{"text/plain", "/v1/sagas/payout", []hdr{key("k8"), {"Content-Type", "text/plain"}}, `{"account":1,"amount":5}`, 415, httpapi.ProblemUnsupportedMediaType, "text/plain"},
		{"latin-1", "/v1/sagas/payout", []hdr{key("k9"), {"Content-Type", "application/json; charset=iso-8859-1"}}, `{"account":1,"amount":5}`, 415, httpapi.ProblemUnsupportedMediaType, "iso-8859-1"},
		{"too large", "/v1/sagas/payout", startHeaders("k10"), `{"account":1,"amount":5,"pad":"` + strings.Repeat("x", 64) + `"}`, 413, httpapi.ProblemBodyTooLarge, "64 bytes"},
		{"missing key", "/v1/sagas/payout", []hdr{jsonType()}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyMissing, "Idempotency-Key"},
		{"two keys", "/v1/sagas/payout", []hdr{jsonType(), key("a"), key("a")}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "exactly one"},
		{"quoted spaces", "/v1/sagas/payout", []hdr{jsonType(), key(`" T-1 "`)}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "space"},
		{"empty quoted", "/v1/sagas/payout", []hdr{jsonType(), key(`""`)}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "empty"},
		{"bad sf-string", "/v1/sagas/payout", []hdr{jsonType(), key(`"T-1`)}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "structured-field"},
		{"sf-string with parameters", "/v1/sagas/payout", []hdr{jsonType(), key(`"T-1";a=1`)}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "structured-field"},
		{"too long", "/v1/sagas/payout", []hdr{jsonType(), key(strings.Repeat("k", 256))}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "255"},
		{"not ASCII", "/v1/sagas/payout", []hdr{jsonType(), key("caf\xc3\xa9")}, `{"account":1,"amount":5}`, 400, httpapi.ProblemKeyInvalid, "printable ASCII"},
	}
	for _, c := range cases {
		r := e.do(t, http.MethodPost, c.path, c.headers, c.body)
		require.Equal(t, c.status, r.status, "%s: %s", c.name, r.body)
		p := r.problem(t)
		require.Equal(t, c.typ, p.Type, c.name)
		require.Contains(t, p.Detail, c.detail, c.name)
	}
	e.nothingWritten(t)

	// charset=utf-8 is application/json too.
	r := e.do(t, http.MethodPost, "/v1/sagas/payout", []hdr{key("ok"), {"Content-Type", "application/json; charset=UTF-8"}}, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
}

// TestStartQuotedKey: "T-1" (an sf-string) and T-1 are one key.
func TestStartQuotedKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	first := e.start(t, `"T-\"1\\"`, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	require.Equal(t, `T-"1\`, started(t, first).Key)
	again := e.start(t, `T-"1\`, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusOK, again.status, "body: %s", again.body)
	require.Equal(t, first.body, again.body)

	plain := e.start(t, "T-2", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, plain.status)
	quoted := e.start(t, `"T-2"`, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusOK, quoted.status)
	require.Equal(t, "true", quoted.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, plain.body, quoted.body)
	require.Equal(t, 2, e.sagaCount(t))
}

// TestStartConcurrent sends 50 starts with one key and one body at once:
// one saga, one 201, and every other answer a replay or a 409.
func TestStartConcurrent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const n = 50
	gate := make(chan struct{})
	answers := make([]response, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-gate
			answers[i], errs[i] = e.send(http.MethodPost, "/v1/sagas/payout", startHeaders("same-key"), `{"account":7,"amount":70}`)
		})
	}
	close(gate)
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	counts := map[int]int{}
	var body []byte
	for _, a := range answers {
		counts[a.status]++
		switch a.status {
		case http.StatusCreated, http.StatusOK:
			if body == nil {
				body = a.body
			}
			require.Equal(t, string(body), string(a.body))
			if a.status == http.StatusOK {
				require.Equal(t, "true", a.header.Get(httpapi.ReplayedHeader))
			}
		case http.StatusConflict:
			require.Equal(t, "1", a.header.Get("Retry-After"))
			require.Equal(t, httpapi.ProblemInFlight, a.problem(t).Type)
		default:
			t.Fatalf("unexpected answer %d: %s", a.status, a.body)
		}
	}
	t.Logf("50 concurrent starts: %d created, %d replayed, %d in flight", counts[201], counts[200], counts[409])
	require.Equal(t, 1, counts[http.StatusCreated])
	require.Equal(t, n, counts[201]+counts[200]+counts[409])
	require.Equal(t, 1, e.sagaCount(t))
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.steps`))

	// Every answer that was not a 409 named the one saga, and a 409 is
	// only for the moment: its retry gets the same answer.
	s := started(t, response{header: http.Header{"Content-Type": {"application/json"}}, body: body})
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.sagas where id = $1 and idem_key = 'same-key'`, s.ID))
	for range counts[http.StatusConflict] {
		r := e.start(t, "same-key", `{"account":7,"amount":70}`)
		require.Equal(t, http.StatusOK, r.status)
		require.Equal(t, string(body), string(r.body))
	}
	require.Equal(t, 1, e.sagaCount(t))
}

// TestStartLostAnswer: a saga started before (through the library, or by
// a request whose answer was lost after its commit) is answered with 200
// and the body its 201 had.
func TestStartLostAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	res, err := e.client.Start(context.Background(), payout, "lost-1", payoutInput{Account: 3, Amount: 30})
	require.NoError(t, err)
	r := e.start(t, "lost-1", `{"amount":30,"account":3}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "true", r.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, fmt.Sprintf(`{"id":"%s","definition":"payout","key":"lost-1","state":"init"}`+"\n", res.ID), string(r.body))
	require.Equal(t, "/v1/sagas/"+res.ID.String(), r.header.Get("Location"))
	require.Equal(t, 1, e.sagaCount(t))
}

// TestStartKeyHeld: while another transaction holds the key's lock, a
// start answers 409 with Retry-After and writes nothing; once it ends,
// the start succeeds.
func TestStartKeyHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var got bool
	require.NoError(t, tx.QueryRow(ctx, `select pg_try_advisory_xact_lock($1)`, httpapi.LockKey("payout", "held")).Scan(&got))
	require.True(t, got)

	r := e.start(t, "held", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusConflict, r.status, "body: %s", r.body)
	require.Equal(t, "1", r.header.Get("Retry-After"))
	require.Equal(t, httpapi.ProblemInFlight, r.problem(t).Type)
	// The lock is the definition's and key's: other keys and other
	// definitions' same key are free.
	require.Equal(t, http.StatusCreated, e.start(t, "free", `{"account":1,"amount":5}`).status)
	require.NotEqual(t, httpapi.LockKey("payout", "held"), httpapi.LockKey("payou", "theld"))
	require.Equal(t, 1, e.sagaCount(t))

	require.NoError(t, tx.Rollback(ctx))
	r = e.start(t, "held", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	require.Equal(t, 2, e.sagaCount(t))
}

// TestStartKeyOfADeadRequest: the process handling a request dies with
// the key held (its database session is killed mid-transaction, as when
// PostgreSQL or the process crashes). Nothing waits for a timeout: the
// very next request with the key starts the saga, with 201, since
// nothing of the first committed.
func TestStartKeyOfADeadRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	conn, err := e.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	var pid int32
	require.NoError(t, tx.QueryRow(ctx, `select pg_backend_pid() from (select pg_advisory_xact_lock($1)) l`, httpapi.LockKey("payout", "dead")).Scan(&pid))
	require.Equal(t, http.StatusConflict, e.start(t, "dead", `{"account":1,"amount":5}`).status)

	var killed bool
	require.NoError(t, e.pool.QueryRow(ctx, `select pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	require.Eventually(t, func() bool {
		var n int
		_ = e.pool.QueryRow(ctx, `select count(*) from pg_stat_activity where pid = $1`, pid).Scan(&n)
		return n == 0
	}, 10*time.Second, 10*time.Millisecond)
	r := e.start(t, "dead", `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	require.Equal(t, 1, e.sagaCount(t))
}
