package httpapi_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/httpapi"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// env is one test's database, engine client and HTTP server on loopback.
type env struct {
	pool   *pgxpool.Pool
	client *engine.Client
	def    *saga.Definition
	srv    *httptest.Server
}

type envOpt func(*httpapi.Config)

// newEnvWith serves the API over a real TCP connection, starting sagas
// through client (which must know def).
func newEnvWith(t *testing.T, pool *pgxpool.Pool, client *engine.Client, def *saga.Definition, opts ...envOpt) *env {
	t.Helper()
	cfg := httpapi.Config{Pool: pool, Client: client, Definition: def, Logger: quietLogger()}
	for _, o := range opts {
		o(&cfg)
	}
	h, err := httpapi.New(cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &env{pool: pool, client: client, def: def, srv: srv}
}

// newEnv uses a client without workers: sagas start and stay in init.
func newEnv(t *testing.T, opts ...envOpt) *env {
	t.Helper()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition}, Logger: quietLogger()})
	require.NoError(t, err)
	return newEnvWith(t, pool, cl, transfer.Definition, opts...)
}

type response struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request. Every header value in headers is added, so a
// name given twice is sent twice.
func (e *env) do(t testing.TB, method, path string, headers [][2]string, body string) response {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.srv.URL+path, rd)
	require.NoError(t, err)
	for _, h := range headers {
		req.Header.Add(h[0], h[1])
	}
	resp, err := e.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

// post sends a JSON body with an Idempotency-Key.
func (e *env) post(t testing.TB, key, body string) response {
	t.Helper()
	return e.do(t, http.MethodPost, "/transfers", [][2]string{{"Idempotency-Key", key}, {"Content-Type", "application/json"}}, body)
}

func (e *env) get(t testing.TB, path string) response {
	t.Helper()
	return e.do(t, http.MethodGet, path, nil, "")
}

func decodeStrict[T any](t testing.TB, body []byte) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&v), "body: %s", body)
	return v
}

// requireProblem checks an RFC 9457 answer and returns it.
func requireProblem(t testing.TB, r response, status int, typ string) httpapi.Problem {
	t.Helper()
	require.Equal(t, status, r.status, "body: %s", r.body)
	require.Equal(t, httpapi.ProblemContentType, r.header.Get("Content-Type"))
	p := decodeStrict[httpapi.Problem](t, r.body)
	require.Equal(t, typ, p.Type)
	require.Equal(t, status, p.Status)
	require.NotEmpty(t, p.Title)
	require.NotEmpty(t, p.Detail)
	return p
}

// counts returns the rows of sagas, steps, outbox and http_idempotency.
func (e *env) counts(t testing.TB) [4]int {
	t.Helper()
	var c [4]int
	require.NoError(t, e.pool.QueryRow(context.Background(), `select
  (select count(*) from idemsaga.sagas), (select count(*) from idemsaga.steps),
  (select count(*) from idemsaga.outbox), (select count(*) from idemsaga.http_idempotency)`).Scan(&c[0], &c[1], &c[2], &c[3]))
	return c
}

func fingerprint(t testing.TB, in transfer.Input) []byte {
	t.Helper()
	canonical, err := saga.CanonicalInput(in)
	require.NoError(t, err)
	sum := sha256.Sum256(canonical)
	return sum[:]
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition}})
	require.NoError(t, err)
	good := httpapi.Config{Pool: pool, Client: cl, Definition: transfer.Definition}
	for name, tc := range map[string]struct {
		mutate func(*httpapi.Config)
		want   string
	}{
		"no pool":              {func(c *httpapi.Config) { c.Pool = nil }, "Config.Pool"},
		"no client":            {func(c *httpapi.Config) { c.Client = nil }, "Config.Client"},
		"no definition":        {func(c *httpapi.Config) { c.Definition = nil }, "Config.Definition"},
		"negative body limit":  {func(c *httpapi.Config) { c.MaxBodyBytes = -1 }, "Config.MaxBodyBytes"},
		"negative ttl":         {func(c *httpapi.Config) { c.KeyTTL = -time.Second }, "Config.KeyTTL"},
		"negative claim":       {func(c *httpapi.Config) { c.ClaimTimeout = -time.Second }, "Config.ClaimTimeout"},
		"ttl within the claim": {func(c *httpapi.Config) { c.KeyTTL = time.Minute; c.ClaimTimeout = time.Minute }, "Config.KeyTTL must exceed"},
	} {
		cfg := good
		tc.mutate(&cfg)
		_, err := httpapi.New(cfg)
		require.ErrorContains(t, err, tc.want, name)
	}
	h, err := httpapi.New(good)
	require.NoError(t, err)
	require.NotNil(t, h)
}

func TestPostStartsTransferAndReplaysFirstAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, func(c *httpapi.Config) { c.KeyTTL = 2 * time.Hour })

	first := e.post(t, "order-1", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	require.Equal(t, "application/json", first.header.Get("Content-Type"))
	require.Empty(t, first.header.Get(httpapi.ReplayedHeader), "a first answer is not a replay")
	got := decodeStrict[httpapi.StartAnswer](t, first.body)
	require.NotEqual(t, uuid.Nil, got.ID)
	require.Equal(t, httpapi.StartAnswer{ID: got.ID, Key: "order-1", State: saga.StateInit, Duplicate: false}, got)
	require.Equal(t, "/transfers/"+got.ID.String(), first.header.Get("Location"))

	// The saga exists under the key, and the answer was stored with it.
	var sagaKey string
	require.NoError(t, e.pool.QueryRow(ctx, `select idem_key from idemsaga.sagas where id = $1`, got.ID).Scan(&sagaKey))
	require.Equal(t, "order-1", sagaKey)
	var ttl time.Duration
	require.NoError(t, e.pool.QueryRow(ctx, `select extract(epoch from expires_at - completed_at)::bigint * 1000000000
from idemsaga.http_idempotency where key = 'order-1'`).Scan(&ttl))
	require.Equal(t, 2*time.Hour, ttl, "the answer is kept for Config.KeyTTL")

	// Replays, including of the same body written differently and of the
	// key as a structured-field string, repeat the first answer exactly.
	for _, tc := range []struct{ key, body string }{
		{"order-1", `{"from":1,"to":2,"amount":30}`},
		{"order-1", "{ \"amount\": 30,\n \"to\": 2, \"from\": 1 }"},
		{`"order-1"`, `{"to":2,"from":1,"amount":30}`},
	} {
		again := e.post(t, tc.key, tc.body)
		require.Equal(t, first.status, again.status)
		require.Equal(t, first.body, again.body, "a replay is byte for byte the first answer")
		require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
		require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
		require.Equal(t, first.header.Get("Content-Type"), again.header.Get("Content-Type"))
	}
	require.Equal(t, [4]int{1, 1, 1, 1}, e.counts(t), "one saga, one step, one command, one stored answer")

	// GET shows the saga and its timeline.
	r := e.get(t, "/transfers/"+got.ID.String())
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	tr := decodeStrict[httpapi.Transfer](t, r.body)
	require.Equal(t, got.ID, tr.ID)
	require.Equal(t, "order-1", tr.Key)
	require.Equal(t, saga.StateInit, tr.State)
	require.False(t, tr.Finished)
	require.Nil(t, tr.FinishedAt)
	require.JSONEq(t, `{"from":1,"to":2,"amount":30}`, string(tr.Input))
	require.Empty(t, tr.Results)
	require.Len(t, tr.Steps, 1)
	st := tr.Steps[0]
	require.Equal(t, transfer.StepDeduct, st.Step)
	require.Equal(t, saga.PhaseForward, st.Phase)
	require.Equal(t, saga.StepDispatched, st.Status)
	require.Equal(t, 1, st.Attempt)
	require.Equal(t, saga.StepKey(got.ID, transfer.StepDeduct, saga.PhaseForward), st.Key)
	require.NotNil(t, st.LeaseUntil)
	require.False(t, st.CreatedAt.IsZero())

	// A key of exactly 255 bytes is fine.
	long := strings.Repeat("k", engine.MaxKeyLength)
	require.Equal(t, http.StatusCreated, e.post(t, long, `{"from":1,"to":2,"amount":1}`).status)
}

func TestPostSameKeyDifferentBodyIs422(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	first := e.post(t, "order-2", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)

	p := requireProblem(t, e.post(t, "order-2", `{"from":1,"to":2,"amount":31}`), http.StatusUnprocessableEntity, httpapi.ProblemKeyReused)
	require.Contains(t, p.Detail, "different request body")
	requireProblem(t, e.post(t, "order-2", `{"from":2,"to":1,"amount":30}`), http.StatusUnprocessableEntity, httpapi.ProblemKeyReused)
	require.Equal(t, [4]int{1, 1, 1, 1}, e.counts(t), "a refused reuse writes nothing")

	// The original body still gets the original answer.
	again := e.post(t, "order-2", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, first.status, again.status)
	require.Equal(t, first.body, again.body)
}

func TestPostWhileInFlightIs409AndAbandonedClaimIsTakenOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	in := transfer.Input{From: 1, To: 2, Amount: 30}
	body := `{"from":1,"to":2,"amount":30}`

	// A request with this key and body is being handled elsewhere: its
	// claim is committed and unanswered.
	_, err := e.pool.Exec(ctx, `insert into idemsaga.http_idempotency (key, request_hash, token, expires_at)
values ('order-3', $1, $2, now() + interval '1 day')`, fingerprint(t, in), uuid.New())
	require.NoError(t, err)

	r := e.post(t, "order-3", body)
	requireProblem(t, r, http.StatusConflict, httpapi.ProblemInFlight)
	require.Equal(t, "1", r.header.Get("Retry-After"))
	// A different body with a key in flight is still a reuse.
	requireProblem(t, e.post(t, "order-3", `{"from":1,"to":2,"amount":99}`), http.StatusUnprocessableEntity, httpapi.ProblemKeyReused)
	require.Equal(t, [4]int{0, 0, 0, 1}, e.counts(t), "only the hand-made claim")

	// The claim's process died: once the claim is older than ClaimTimeout,
	// the next request with the same key and body takes it over.
	_, err = e.pool.Exec(ctx, `update idemsaga.http_idempotency set claimed_at = now() - interval '2 minutes' where key = 'order-3'`)
	require.NoError(t, err)
	first := e.post(t, "order-3", body)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	require.Equal(t, [4]int{1, 1, 1, 1}, e.counts(t))
	again := e.post(t, "order-3", body)
	require.Equal(t, first.body, again.body)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
}

// TestPostWhileHeldIs409 holds a claim the way a slow request does: a
// request handling the key is inside its transaction while another comes.
func TestPostWhileHeldIs409(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	in := transfer.Input{From: 1, To: 2, Amount: 5}
	token := uuid.New()
	_, err := e.pool.Exec(ctx, `insert into idemsaga.http_idempotency (key, request_hash, token, expires_at)
values ('order-4', $1, $2, now() + interval '1 day')`, fingerprint(t, in), token)
	require.NoError(t, err)
	// The holder starts the saga in its transaction and has not committed.
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	res, err := e.client.StartTx(ctx, tx, transfer.Definition, "order-4", in)
	require.NoError(t, err)

	requireProblem(t, e.post(t, "order-4", `{"from":1,"to":2,"amount":5}`), http.StatusConflict, httpapi.ProblemInFlight)

	// The holder answers and commits; the waiting client's retry replays.
	answer := []byte(`{"id":"` + res.ID.String() + `","key":"order-4","state":"init","duplicate":false}` + "\n")
	tag, err := tx.Exec(ctx, `update idemsaga.http_idempotency set status = 201, body = $2, content_type = 'application/json',
location = '/transfers/' || $3::text, completed_at = now() where key = 'order-4' and token = $1`, token, answer, res.ID)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	require.NoError(t, tx.Commit(ctx))
	r := e.post(t, "order-4", `{"from":1,"to":2,"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, answer, r.body)
	require.Equal(t, "/transfers/"+res.ID.String(), r.header.Get("Location"))
}

func TestPostConcurrentSameKeyStartsOneSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	const n = 20
	results := make([]response, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			results[i] = e.post(t, "order-5", `{"from":3,"to":4,"amount":7}`)
		})
	}
	close(start)
	wg.Wait()

	var success []byte
	created, conflicts := 0, 0
	for _, r := range results {
		switch r.status {
		case http.StatusCreated:
			created++
			if success == nil {
				success = r.body
			}
			require.Equal(t, success, r.body, "every success is the same answer")
		case http.StatusConflict:
			conflicts++
			requireProblem(t, r, http.StatusConflict, httpapi.ProblemInFlight)
		default:
			t.Fatalf("unexpected answer %d: %s", r.status, r.body)
		}
	}
	require.GreaterOrEqual(t, created, 1, "at least one request succeeds")
	require.Equal(t, n, created+conflicts)
	t.Logf("%d answered 201, %d answered 409", created, conflicts)

	var sagas int
	require.NoError(t, e.pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where idem_key = 'order-5'`).Scan(&sagas))
	require.Equal(t, 1, sagas, "exactly one saga")
	require.Equal(t, [4]int{1, 1, 1, 1}, e.counts(t))
	got := decodeStrict[httpapi.StartAnswer](t, success)
	require.False(t, got.Duplicate)

	// After the dust settles every retry replays.
	r := e.post(t, "order-5", `{"from":3,"to":4,"amount":7}`)
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, success, r.body)
}

func TestPostBadRequestsWriteNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	valid := `{"from":1,"to":2,"amount":30}`
	ct := [2]string{"Content-Type", "application/json"}
	key := [2]string{"Idempotency-Key", "bad-1"}
	for _, tc := range []struct {
		name     string
		headers  [][2]string
		body     string
		status   int
		problem  string
		contains string
	}{
		{"missing key", [][2]string{ct}, valid, 400, httpapi.ProblemKeyMissing, "Idempotency-Key"},
		{"empty key", [][2]string{ct, {"Idempotency-Key", ""}}, valid, 400, httpapi.ProblemKeyInvalid, "empty"},
		{"empty quoted key", [][2]string{ct, {"Idempotency-Key", `""`}}, valid, 400, httpapi.ProblemKeyInvalid, "empty"},
		{"key too long", [][2]string{ct, {"Idempotency-Key", strings.Repeat("k", 256)}}, valid, 400, httpapi.ProblemKeyInvalid, "256 bytes"},
		{"two keys", [][2]string{ct, key, {"Idempotency-Key", "bad-2"}}, valid, 400, httpapi.ProblemKeyInvalid, "exactly one"},
		{"non-ASCII key", [][2]string{ct, {"Idempotency-Key", "schlüssel"}}, valid, 400, httpapi.ProblemKeyInvalid, "ASCII"},
		{"unterminated quoted key", [][2]string{ct, {"Idempotency-Key", `"bad-1`}}, valid, 400, httpapi.ProblemKeyInvalid, "quoted"},
		{"no content type", [][2]string{key}, valid, 415, httpapi.ProblemUnsupportedMediaType, "application/json"},
		{"text content type", [][2]string{key, {"Content-Type", "text/plain"}}, valid, 415, httpapi.ProblemUnsupportedMediaType, "text/plain"},
		{"form content type", [][2]string{key, {"Content-Type", "application/x-www-form-urlencoded"}}, "from=1&to=2&amount=3", 415, httpapi.ProblemUnsupportedMediaType, "application/json"},
		{"latin-1 json", [][2]string{key, {"Content-Type", "application/json; charset=iso-8859-1"}}, valid, 415, httpapi.ProblemUnsupportedMediaType, "UTF-8"},
		{"empty body", [][2]string{key, ct}, "", 400, httpapi.ProblemMalformedBody, "empty"},
		{"truncated json", [][2]string{key, ct}, `{"from":1,"to":2,`, 400, httpapi.ProblemMalformedBody, "truncated"},
		{"bad json", [][2]string{key, ct}, `{from:1}`, 400, httpapi.ProblemMalformedBody, "not valid JSON"},
		{"unknown field", [][2]string{key, ct}, `{"from":1,"to":2,"amount":3,"memo":"x"}`, 400, httpapi.ProblemMalformedBody, "memo"},
		{"missing amount", [][2]string{key, ct}, `{"from":1,"to":2}`, 400, httpapi.ProblemMalformedBody, "missing field(s): amount"},
		{"null amount", [][2]string{key, ct}, `{"from":1,"to":2,"amount":null}`, 400, httpapi.ProblemMalformedBody, "amount"},
		{"null body", [][2]string{key, ct}, `null`, 400, httpapi.ProblemMalformedBody, "from, to, amount"},
		{"array body", [][2]string{key, ct}, `[1,2,3]`, 400, httpapi.ProblemMalformedBody, "JSON object"},
		{"string amount", [][2]string{key, ct}, `{"from":1,"to":2,"amount":"3"}`, 400, httpapi.ProblemMalformedBody, "amount"},
		{"fractional amount", [][2]string{key, ct}, `{"from":1,"to":2,"amount":1.5}`, 400, httpapi.ProblemMalformedBody, "amount"},
		{"two objects", [][2]string{key, ct}, valid + valid, 400, httpapi.ProblemMalformedBody, "more than one"},
		{"zero amount", [][2]string{key, ct}, `{"from":1,"to":2,"amount":0}`, 400, httpapi.ProblemInvalidTransfer, "positive"},
		{"negative amount", [][2]string{key, ct}, `{"from":1,"to":2,"amount":-5}`, 400, httpapi.ProblemInvalidTransfer, "positive"},
		{"same account", [][2]string{key, ct}, `{"from":3,"to":3,"amount":5}`, 400, httpapi.ProblemInvalidTransfer, "same account"},
		{"oversized body", [][2]string{key, ct}, `{"from":1,"to":2,"amount":3` + strings.Repeat(" ", httpapi.MaxBodyBytesDefault) + `}`, 413, httpapi.ProblemBodyTooLarge, "16384 bytes"},
	} {
		r := e.do(t, http.MethodPost, "/transfers", tc.headers, tc.body)
		p := requireProblem(t, r, tc.status, tc.problem)
		require.Contains(t, p.Detail, tc.contains, tc.name)
	}
	require.Equal(t, [4]int{0, 0, 0, 0}, e.counts(t), "no saga, step, command or idempotency row")

	// The key used by the refused requests is still free.
	require.Equal(t, http.StatusCreated, e.post(t, "bad-1", valid).status)
}

func TestPostDuplicateOfSagaStartedElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	// The CLI started this intent before the HTTP call came.
	cli, err := e.client.Start(ctx, transfer.Definition, "order-6", transfer.Input{From: 1, To: 2, Amount: 30})
	require.NoError(t, err)

	r := e.post(t, "order-6", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	got := decodeStrict[httpapi.StartAnswer](t, r.body)
	require.Equal(t, httpapi.StartAnswer{ID: cli.ID, Key: "order-6", State: saga.StateInit, Duplicate: true}, got)
	require.Equal(t, "/transfers/"+cli.ID.String(), r.header.Get("Location"))
	again := e.post(t, "order-6", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, r.status, again.status)
	require.Equal(t, r.body, again.body)

	// The CLI used a key for another input: the HTTP request is refused and
	// leaves no trace.
	_, err = e.client.Start(ctx, transfer.Definition, "order-7", transfer.Input{From: 1, To: 2, Amount: 1})
	require.NoError(t, err)
	p := requireProblem(t, e.post(t, "order-7", `{"from":1,"to":2,"amount":2}`), http.StatusUnprocessableEntity, httpapi.ProblemKeyReused)
	require.Contains(t, p.Detail, "different input")
	var rows int
	require.NoError(t, e.pool.QueryRow(ctx, `select count(*) from idemsaga.http_idempotency where key = 'order-7'`).Scan(&rows))
	require.Zero(t, rows)
	require.Equal(t, [4]int{2, 2, 2, 1}, e.counts(t))
}

func TestPostAfterAnswerExpired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	first := e.post(t, "order-8", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	id := decodeStrict[httpapi.StartAnswer](t, first.body).ID
	expire := func() {
		_, err := e.pool.Exec(ctx, `update idemsaga.http_idempotency set expires_at = now() - interval '1 second' where key = 'order-8'`)
		require.NoError(t, err)
	}

	// The stored answer is gone, but the saga's key still holds: the same
	// body gets the same saga, a different one is refused.
	expire()
	r := e.post(t, "order-8", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, httpapi.StartAnswer{ID: id, Key: "order-8", State: saga.StateInit, Duplicate: true}, decodeStrict[httpapi.StartAnswer](t, r.body))
	expire()
	requireProblem(t, e.post(t, "order-8", `{"from":1,"to":2,"amount":31}`), http.StatusUnprocessableEntity, httpapi.ProblemKeyReused)
	require.Equal(t, [4]int{1, 1, 1, 0}, e.counts(t), "the refused request released its claim on the expired key")
}

func TestGetTransfer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	other := saga.MustNew("other", saga.Step{Kind: saga.DatabaseStep, Name: "only", Reaches: "done",
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition, other}})
	require.NoError(t, err)
	e := newEnvWith(t, pool, cl, transfer.Definition)

	requireProblem(t, e.get(t, "/transfers/not-a-uuid"), http.StatusBadRequest, httpapi.ProblemInvalidID)
	requireProblem(t, e.get(t, "/transfers/"+uuid.NewString()), http.StatusNotFound, httpapi.ProblemNotFound)
	// A saga of another definition is not a transfer.
	res, err := cl.Start(ctx, other, "o-1", map[string]int{"x": 1})
	require.NoError(t, err)
	requireProblem(t, e.get(t, "/transfers/"+res.ID.String()), http.StatusNotFound, httpapi.ProblemNotFound)
	// Methods the route does not serve.
	require.Equal(t, http.StatusMethodNotAllowed, e.do(t, http.MethodDelete, "/transfers/"+res.ID.String(), nil, "").status)
	require.Equal(t, http.StatusMethodNotAllowed, e.get(t, "/transfers").status)
}

// TestTransferRunsToCredited runs a real engine (relay, step workers,
// orchestrator over an in-process JetStream) behind the API and polls GET
// until the saga is credited.
func TestTransferRunsToCredited(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	seeded, err := transfer.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	def, err := transfer.NewDefinition(saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Timeout: 10 * time.Second})
	require.NoError(t, err)
	stream := testenv.Name("HTTP")
	eng, err := engine.New(engine.Config{
		Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond,
		Logger: quietLogger(),
	})
	require.NoError(t, err)
	require.NoError(t, eng.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, eng.Stop(ctx))
	})
	e := newEnvWith(t, pool, eng.Client(), def)

	first := e.post(t, "order-9", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	location := first.header.Get("Location")

	var tr httpapi.Transfer
	deadline := time.Now().Add(30 * time.Second)
	for {
		r := e.get(t, location)
		require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
		tr = decodeStrict[httpapi.Transfer](t, r.body)
		if tr.Finished {
			break
		}
		require.True(t, time.Now().Before(deadline), "transfer still %q after 30s", tr.State)
		time.Sleep(20 * time.Millisecond)
	}
	require.Equal(t, transfer.StateCredited, tr.State, "error: %s", tr.Error)
	require.NotNil(t, tr.FinishedAt)
	require.Empty(t, tr.Error)
	require.Len(t, tr.Steps, 2)
	for i, name := range []string{transfer.StepDeduct, transfer.StepCredit} {
		st := tr.Steps[i]
		require.Equal(t, name, st.Step)
		require.Equal(t, saga.PhaseForward, st.Phase)
		require.Equal(t, saga.StepSucceeded, st.Status)
		require.Equal(t, 1, st.Attempt)
		require.Equal(t, saga.StepKey(tr.ID, name, saga.PhaseForward), st.Key)
		require.NotEmpty(t, st.Result)
	}
	require.JSONEq(t, `{"account":1,"amount":-30}`, string(tr.Results[transfer.StepDeduct]))
	require.JSONEq(t, `{"account":2,"amount":30}`, string(tr.Results[transfer.StepCredit]))

	var b1, b2 int64
	require.NoError(t, pool.QueryRow(ctx, `select (select balance from transfer.accounts where id = 1), (select balance from transfer.accounts where id = 2)`).Scan(&b1, &b2))
	require.Equal(t, []int64{70, 130}, []int64{b1, b2})
	rep, err := transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)

	// A late retry of the request still gets the first answer and moves
	// no money.
	again := e.post(t, "order-9", `{"from":1,"to":2,"amount":30}`)
	require.Equal(t, first.status, again.status)
	require.Equal(t, first.body, again.body)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.NoError(t, pool.QueryRow(ctx, `select (select balance from transfer.accounts where id = 1), (select balance from transfer.accounts where id = 2)`).Scan(&b1, &b2))
	require.Equal(t, []int64{70, 130}, []int64{b1, b2})
}
