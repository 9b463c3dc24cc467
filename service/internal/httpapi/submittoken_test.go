package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// note is a second definition, for tokens of another definition.
var note = saga.MustNew("note", saga.Step{Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
	Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})

// tokenEnv is newEnv with a second definition and the engine's clock
// replaced, in this test's database, by one the test moves (as the test
// kit's): advance moves it forward.
type tokenEnv struct {
	*env
	advance func(time.Duration)
}

func newTokenEnv(t *testing.T, opts ...envOpt) tokenEnv {
	t.Helper()
	pool := testenv.DB(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `create table public.fake_clock (offset_ms bigint not null);
insert into public.fake_clock values (0);
create or replace function idemsaga.now() returns timestamptz language sql stable parallel safe
as $$ select pg_catalog.now() + (select offset_ms from public.fake_clock) * interval '1 millisecond' $$`)
	require.NoError(t, err)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{payout, note}, Logger: quietLogger()})
	require.NoError(t, err)
	return tokenEnv{env: serve(t, pool, cl, opts...), advance: func(d time.Duration) {
		t.Helper()
		_, err := pool.Exec(ctx, `update public.fake_clock set offset_ms = offset_ms + $1`, d.Milliseconds())
		require.NoError(t, err)
	}}
}

// issue posts body to /v1/tokens.
func (e *env) issue(t testing.TB, body string) response {
	t.Helper()
	return e.do(t, http.MethodPost, "/v1/tokens", []hdr{jsonType()}, body)
}

// issued issues a token for definition and returns it.
func (e *env) issued(t testing.TB, definition string) httpapi.SubmitToken {
	t.Helper()
	r := e.issue(t, fmt.Sprintf(`{"definition":%q}`, definition))
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	var tok httpapi.SubmitToken
	dec := json.NewDecoder(strings.NewReader(string(r.body)))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&tok))
	return tok
}

func tokenCount(t testing.TB, pool *pgxpool.Pool, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.submit_tokens where `+where, args...).Scan(&n))
	return n
}

// TestSubmitTokenIssue issues tokens with the default and a given time to
// live, and refuses every malformed request without issuing one.
func TestSubmitTokenIssue(t *testing.T) {
	t.Parallel()
	e := newTokenEnv(t, func(c *httpapi.Config) { c.SubmitTokenTTL = 10 * time.Minute; c.MaxSubmitTokenTTL = 2 * time.Hour })
	r := e.issue(t, `{"definition":"payout"}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	require.Equal(t, "no-store", r.header.Get("Cache-Control"))
	tok := e.issued(t, "payout")
	require.True(t, strings.HasPrefix(tok.Token, "st_"), tok.Token)
	require.Equal(t, "payout", tok.Definition)
	require.Equal(t, int64(600), tok.TTLSeconds)
	require.Equal(t, 1, tokenCount(t, e.pool, `token = $1 and expires_at = $2 and expires_at - issued_at = interval '10 minutes'`, tok.Token, tok.ExpiresAt))

	r = e.issue(t, `{"ttl_seconds":7200,"definition":"note"}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	var long httpapi.SubmitToken
	require.NoError(t, json.Unmarshal(r.body, &long))
	require.Equal(t, httpapi.SubmitToken{Token: long.Token, Definition: "note", ExpiresAt: long.ExpiresAt, TTLSeconds: 7200}, long)
	require.Equal(t, 1, tokenCount(t, e.pool, `token = $1 and definition = 'note' and expires_at - issued_at = interval '2 hours'`, long.Token))
	require.Equal(t, 3, tokenCount(t, e.pool, `true`))

	cases := []struct {
		name, body string
		headers    []hdr
		status     int
		typ        string
		detail     string
	}{
		{"unknown definition", `{"definition":"nope"}`, nil, 404, httpapi.ProblemUnknownDefinition, `"nope"`},
		{"no definition", `{"ttl_seconds":600}`, nil, 400, httpapi.ProblemMalformedRequest, `"definition" is missing`},
		{"empty definition", `{"definition":""}`, nil, 400, httpapi.ProblemMalformedRequest, `"definition" must be`},
		{"unknown member", `{"definition":"payout","ttl":600}`, nil, 400, httpapi.ProblemMalformedRequest, `"ttl" is unknown`},
		{"case twin", `{"definition":"payout","Definition":"note"}`, nil, 400, httpapi.ProblemMalformedRequest, `"Definition" is unknown`},
		{"twice", `{"definition":"payout","definition":"note"}`, nil, 400, httpapi.ProblemMalformedRequest, "twice"},
		{"ttl too short", `{"definition":"payout","ttl_seconds":59}`, nil, 400, httpapi.ProblemMalformedRequest, "outside 60 to 7200"},
		{"ttl over the maximum", `{"definition":"payout","ttl_seconds":7201}`, nil, 400, httpapi.ProblemMalformedRequest, "outside 60 to 7200"},
		{"ttl not whole", `{"definition":"payout","ttl_seconds":600.5}`, nil, 400, httpapi.ProblemMalformedRequest, "whole number"},
		{"ttl a string", `{"definition":"payout","ttl_seconds":"600"}`, nil, 400, httpapi.ProblemMalformedRequest, "whole number"},
		{"not an object", `["payout"]`, nil, 400, httpapi.ProblemMalformedRequest, "not a JSON object"},
		{"two values", `{"definition":"payout"} {}`, nil, 400, httpapi.ProblemMalformedRequest, "more than one"},
		{"empty", ``, nil, 400, httpapi.ProblemMalformedRequest, "not a JSON object"},
		{"not JSON", `{"definition":"payout"`, nil, 400, httpapi.ProblemMalformedRequest, "not valid JSON"},
		{"no content type", `{"definition":"payout"}`, []hdr{}, 415, httpapi.ProblemUnsupportedMediaType, "application/json"},
	}
	for _, c := range cases {
		headers := []hdr{jsonType()}
		if c.headers != nil {
			headers = c.headers
		}
		r := e.do(t, http.MethodPost, "/v1/tokens", headers, c.body)
		require.Equal(t, c.status, r.status, "%s: %s", c.name, r.body)
		p := r.problem(t)
		require.Equal(t, c.typ, p.Type, c.name)
		require.Contains(t, p.Detail, c.detail, c.name)
	}
	require.Equal(t, 3, tokenCount(t, e.pool, `true`), "a refused request issues nothing")

	r = e.do(t, http.MethodGet, "/v1/tokens", nil, "")
	require.Equal(t, http.StatusMethodNotAllowed, r.status)
	require.Equal(t, "POST", r.header.Get("Allow"))

	// The API's configuration bounds the time to live.
	for _, cfg := range []httpapi.Config{
		{SubmitTokenTTL: 30 * time.Second},
		{SubmitTokenTTL: 3 * time.Hour, MaxSubmitTokenTTL: 2 * time.Hour},
		{MaxSubmitTokenTTL: 25 * time.Hour},
		{SubmitTokenTTL: 90500 * time.Millisecond},
	} {
		cfg.Client = e.client
		_, err := httpapi.New(cfg)
		require.ErrorContains(t, err, "SubmitTokenTTL", "%+v", cfg)
	}
}

// TestSubmitTokenSubmit starts a saga with a token, replays it with the
// same body (also past the token's expiry), and refuses another body.
func TestSubmitTokenSubmit(t *testing.T) {
	t.Parallel()
	e := newTokenEnv(t)
	tok := e.issued(t, "payout")
	first := e.start(t, tok.Token, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	s := started(t, first)
	require.Equal(t, tok.Token, s.Key)
	require.Equal(t, 1, tokenCount(t, e.pool, `token = $1 and saga_id = $2 and consumed_at is not null`, tok.Token, s.ID))

	again := e.start(t, tok.Token, `{"amount":5,"account":1}`)
	require.Equal(t, http.StatusOK, again.status, "body: %s", again.body)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, first.body, again.body)

	other := e.start(t, tok.Token, `{"account":1,"amount":6}`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "body: %s", other.body)
	require.Equal(t, httpapi.ProblemKeyReused, other.problem(t).Type)
	require.Equal(t, 1, e.sagaCount(t))
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.outbox`))

	e.advance(2 * time.Hour)
	late := e.start(t, tok.Token, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusOK, late.status, "body: %s", late.body)
	require.Equal(t, first.body, late.body)
	require.Equal(t, 1, e.sagaCount(t))
}

// TestSubmitTokenRefused: a token never issued, one of another
// definition and an expired one are answered 400 with the problem that
// says to fetch a new token, and start nothing.
func TestSubmitTokenRefused(t *testing.T) {
	t.Parallel()
	e := newTokenEnv(t)
	expiring := e.issued(t, "payout")
	e.advance(time.Hour)
	live := e.issued(t, "payout")
	ofNote := e.issued(t, "note")

	cases := []struct {
		name, key, detail string
	}{
		{"never issued", "st_" + strings.Repeat("A", 43), "was not issued"},
		{"a client key with the prefix", "st_order-17", "was not issued"},
		{"another definition", ofNote.Token, "issued for a saga of note, not of payout"},
		{"expired", expiring.Token, "expired at " + expiring.ExpiresAt.UTC().Format(time.RFC3339)},
	}
	for _, c := range cases {
		r := e.start(t, c.key, `{"account":1,"amount":5}`)
		require.Equal(t, http.StatusBadRequest, r.status, "%s: %s", c.name, r.body)
		p := r.problem(t)
		require.Equal(t, httpapi.ProblemSubmitTokenInvalid, p.Type, c.name)
		require.Contains(t, p.Detail, c.detail, c.name)
		require.Contains(t, p.Detail, `nothing was written: fetch a new token for payout and submit with it (POST /v1/tokens with {"definition":"payout"} issues one)`, c.name)
	}
	e.nothingWritten(t)
	require.Equal(t, 3, tokenCount(t, e.pool, `consumed_at is null`))

	// A live token, and the note's token for its own definition, start
	// their sagas.
	require.Equal(t, http.StatusCreated, e.start(t, live.Token, `{"account":1,"amount":5}`).status)
	r := e.do(t, http.MethodPost, "/v1/sagas/note", startHeaders(ofNote.Token), `{}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	require.Equal(t, 2, e.sagaCount(t))
}

// TestSubmitTokenConsumedOnlyOnCommit: a submit refused for its input
// leaves the token usable.
func TestSubmitTokenConsumedOnlyOnCommit(t *testing.T) {
	t.Parallel()
	e := newTokenEnv(t)
	tok := e.issued(t, "payout")
	for _, body := range []string{`{"account":1,"amount":-5}`, `{"account":1,"amount":5,"AMOUNT":7000}`, `{"account":1`} {
		r := e.start(t, tok.Token, body)
		require.Equal(t, http.StatusBadRequest, r.status, "body: %s", r.body)
		require.Equal(t, httpapi.ProblemInvalidInput, r.problem(t).Type)
	}
	e.nothingWritten(t)
	require.Equal(t, 1, tokenCount(t, e.pool, `consumed_at is null`))
	r := e.start(t, tok.Token, `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
}

// TestSubmitTokenConcurrentSubmits sends 50 submits of one token and one
// body at once: one saga, one 201, every other answer a replay of it or
// a 409, and none refuses the token.
func TestSubmitTokenConcurrentSubmits(t *testing.T) {
	t.Parallel()
	e := newTokenEnv(t)
	tok := e.issued(t, "payout")
	const n = 50
	gate := make(chan struct{})
	answers := make([]response, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-gate
			answers[i], errs[i] = e.send(http.MethodPost, "/v1/sagas/payout", startHeaders(tok.Token), `{"account":7,"amount":70}`)
		})
	}
	close(gate)
	wg.Wait()
	counts := map[int]int{}
	var body []byte
	for i, a := range answers {
		require.NoError(t, errs[i])
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
			require.Equal(t, httpapi.ProblemInFlight, a.problem(t).Type)
		default:
			t.Fatalf("unexpected answer %d: %s", a.status, a.body)
		}
	}
	t.Logf("50 concurrent submits of one token: %d created, %d replayed, %d in flight", counts[201], counts[200], counts[409])
	require.Equal(t, 1, counts[http.StatusCreated])
	require.Equal(t, 1, e.sagaCount(t))
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.steps`))
	s := started(t, response{header: http.Header{"Content-Type": {"application/json"}}, body: body})
	require.Equal(t, 1, tokenCount(t, e.pool, `token = $1 and saga_id = $2`, tok.Token, s.ID))
	for range counts[http.StatusConflict] {
		r := e.start(t, tok.Token, `{"account":7,"amount":70}`)
		require.Equal(t, http.StatusOK, r.status)
		require.Equal(t, string(body), string(r.body))
	}
}

// TestSubmitTokenNeedsAuth: with API tokens configured, issuing needs one
// like every other route.
func TestSubmitTokenNeedsAuth(t *testing.T) {
	t.Parallel()
	tokens, err := httpapi.ParseTokens("api-token-0123456789")
	require.NoError(t, err)
	e := newTokenEnv(t, func(c *httpapi.Config) { c.Tokens = tokens })
	r := e.issue(t, `{"definition":"payout"}`)
	require.Equal(t, http.StatusUnauthorized, r.status)
	require.Zero(t, tokenCount(t, e.pool, `true`))
	e.token = "api-token-0123456789"
	require.Equal(t, http.StatusCreated, e.issue(t, `{"definition":"payout"}`).status)
}
