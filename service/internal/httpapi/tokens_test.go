package httpapi_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestParseTokens: errors name the line and never the token.
func TestParseTokens(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, text, secret, want string }{
		{"short", "# comment\nshort-secret-1\n", "short-secret-1", "line 2"},
		{"space inside", "good-token-0123456789\nhas a space inside it!\n", "has a space", "line 2"},
		{"control", "tab\tinside-the-token-xx\n", "inside-the-token", "line 1"},
		{"not ASCII", "caf\xc3\xa9-token-0123456789\n", "-token-0123", "line 1"},
		{"empty", "\n# only comments\n\n", "only comments", "no token"},
	} {
		_, err := httpapi.ParseTokens(c.text)
		require.Error(t, err, c.name)
		require.Contains(t, err.Error(), c.want, c.name)
		require.NotContains(t, err.Error(), c.secret, c.name)
	}
	tok, err := httpapi.ParseTokens("dup-token-0123456789\ndup-token-0123456789\n#x\n")
	require.NoError(t, err)
	require.Equal(t, 1, tok.Len())
	require.Zero(t, (*httpapi.Tokens)(nil).Len())
}

// TestLoadTokens: errors name the path, never the contents.
func TestLoadTokens(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "tokens")
	_, err := httpapi.LoadTokens(path)
	require.ErrorContains(t, err, path)

	require.NoError(t, os.WriteFile(path, []byte("too-short-1\n"), 0o600))
	_, err = httpapi.LoadTokens(path)
	require.ErrorContains(t, err, path)
	require.ErrorContains(t, err, "line 1")
	require.NotContains(t, err.Error(), "too-short-1")

	require.NoError(t, os.WriteFile(path, []byte("long-enough-token-123\n"), 0o600))
	tok, err := httpapi.LoadTokens(path)
	require.NoError(t, err)
	require.Equal(t, 1, tok.Len())
}

// TestRequire: nothing of a refused request reaches the handler, and an
// empty Tokens refuses all.
func TestRequire(t *testing.T) {
	t.Parallel()
	tok, err := httpapi.ParseTokens("long-enough-token-123")
	require.NoError(t, err)
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { served++ })
	for _, c := range []struct {
		tokens *httpapi.Tokens
		auth   string
		status int
	}{
		{tok, "", 401}, {tok, "Bearer long-enough-token-12", 401}, {tok, "Bearer long-enough-token-123", 200},
		{tok, "BEARER   long-enough-token-123", 200}, {&httpapi.Tokens{}, "Bearer long-enough-token-123", 401},
	} {
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		if c.auth != "" {
			r.Header.Set("Authorization", c.auth)
		}
		c.tokens.Require(next).ServeHTTP(w, r)
		require.Equal(t, c.status, w.Code, c.auth)
		if c.status == 401 {
			require.Equal(t, httpapi.ProblemContentType, w.Header().Get("Content-Type"))
			require.Contains(t, w.Header().Get("WWW-Authenticate"), "Bearer")
		}
	}
	require.Equal(t, 2, served)
}

// TestParseNamedTokens: the long form names a token, its scope and its
// definitions; a bare token is an operator over all, named by its digest.
func TestParseNamedTokens(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, text, want string }{
		{"two fields", "alice operator-token-0123456789\n", "line 1 has 2 fields"},
		{"bad scope", "alice admin * alice-token-0123456789\n", `scope "admin"`},
		{"bad name", "al/ice read * alice-token-0123456789\n", `name "al/ice"`},
		{"empty definition", "alice read a,,b alice-token-0123456789\n", "empty name"},
		{"same name", "alice read * alice-token-0123456789\nalice read * alice-token-9876543210\n", "line 2: the name \"alice\" is the name of line 1"},
		{"same token", "alice read * alice-token-0123456789\nbob read * alice-token-0123456789\n", "line 2: the token is on an earlier line"},
		{"short", "alice read * short\n", "line 1: the token is 5 characters"},
	} {
		_, err := httpapi.ParseTokens(c.text)
		require.ErrorContains(t, err, c.want, c.name)
		require.NotContains(t, err.Error(), "token-0123456789", c.name)
	}
	tok, err := httpapi.ParseTokens("# name scope definitions token\nalice operator * alice-token-0123456789\n\tgrafana\tread\tpayout,refund\tgrafana-token-0123456789\nbare-token-0123456789\n")
	require.NoError(t, err)
	require.Equal(t, 3, tok.Len())
}

// tokensFile is the tokens of TestTokenScopes.
const tokensFile = `alice    operator *      alice-token-0123456789
grafana  read     *      grafana-token-0123456789
web      start    payout web-token-0123456789
refunds  operator refund refunds-token-0123456789
bare-token-0123456789
`

// TestTokenScopes: every route refuses a token whose scope is below the
// route's with 403, and does nothing; a token that covers some
// definitions only cannot read or change the sagas of others; a repair is
// recorded under the name of the token that made it.
func TestTokenScopes(t *testing.T) {
	t.Parallel()
	tokens, err := httpapi.ParseTokens(tokensFile)
	require.NoError(t, err)
	e := newEnv(t, func(c *httpapi.Config) { c.Tokens = tokens })
	as := func(tok string) *env { c := *e; c.token = tok; return &c }
	alice, grafana, web, refunds, bare := as("alice-token-0123456789"), as("grafana-token-0123456789"), as("web-token-0123456789"),
		as("refunds-token-0123456789"), as("bare-token-0123456789")

	s := started(t, web.start(t, "scoped-1", `{"account":4,"amount":40}`))
	sagaPath := "/v1/sagas/" + s.ID.String()
	denied := func(who *env, method, path, body string) {
		t.Helper()
		h := []hdr{key("k-" + uuid.NewString())}
		if body != "" {
			h = append(h, jsonType())
		}
		r := who.do(t, method, path, h, body)
		require.Equal(t, http.StatusForbidden, r.status, "%s %s: %s", method, path, r.body)
		require.Equal(t, httpapi.ProblemForbidden, r.problem(t).Type)
	}
	// A read token may read everything and write nothing.
	for _, p := range []string{sagaPath, "/v1/sagas", "/v1/definitions", "/v1/schedules", "/v1/event-dead-letters", "/v1/openapi.json"} {
		r := grafana.do(t, http.MethodGet, p, nil, "")
		require.Equal(t, http.StatusOK, r.status, "%s: %s", p, r.body)
	}
	for _, op := range []string{"cancel", "retry", "close", "pause", "resume"} {
		denied(grafana, http.MethodPost, sagaPath+"/"+op, "")
		denied(web, http.MethodPost, sagaPath+"/"+op, "")
	}
	// Every write route of the OpenAPI document refuses a read token.
	var doc struct {
		Paths map[string]map[string]any `json:"paths"`
	}
	require.NoError(t, json.Unmarshal(grafana.do(t, http.MethodGet, "/v1/openapi.json", nil, "").body, &doc))
	writes := 0
	for p, ops := range doc.Paths {
		if _, ok := ops["post"]; !ok {
			continue
		}
		p = strings.NewReplacer("{id}", s.ID.String(), "{definition}", "payout", "{token}", "cb_x").Replace(p)
		denied(grafana, http.MethodPost, p, `{}`)
		writes++
	}
	require.GreaterOrEqual(t, writes, 12, "the document lists the write routes")
	denied(grafana, http.MethodPost, "/v1/sagas/payout", `{"account":4,"amount":40}`)
	denied(grafana, http.MethodPost, "/v1/tokens", `{"definition":"payout"}`)
	denied(web, http.MethodPost, "/v1/repairs", `{"operation":"cancel","filter":{"definition":"payout"},"dry_run":true}`)
	denied(web, http.MethodPost, "/v1/definitions/payout/pause", "")
	denied(web, http.MethodPost, "/v1/schedules/payout/pause", "")

	// A token that covers refund only reads and changes no payout.
	denied(refunds, http.MethodGet, sagaPath, "")
	denied(refunds, http.MethodGet, "/v1/sagas", "")
	denied(refunds, http.MethodGet, "/v1/sagas?definition=payout", "")
	denied(refunds, http.MethodPost, sagaPath+"/cancel", "")
	denied(refunds, http.MethodPost, "/v1/definitions/payout/pause", "")
	denied(refunds, http.MethodPost, "/v1/repairs", `{"operation":"cancel","filter":{"state":"init"},"dry_run":true}`)
	denied(refunds, http.MethodPost, "/v1/sagas/payout", `{"account":4,"amount":40}`)
	denied(web, http.MethodGet, "/v1/sagas?definition=refund", "")
	require.Equal(t, 1, e.sagaCount(t), "no refused request started a saga")
	require.Zero(t, e.count(t, `select count(*) from idemsaga.repairs`), "no refused request repaired")
	require.Zero(t, e.count(t, `select count(*) from idemsaga.paused_definitions`), "no refused request paused")

	// The repairs say who made them.
	r := alice.do(t, http.MethodPost, sagaPath+"/pause", []hdr{key("p-1")}, "")
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	r = bare.do(t, http.MethodPost, sagaPath+"/resume", []hdr{key("r-1")}, "")
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	var by []string
	rows, err := e.pool.Query(context.Background(), `select requested_by from idemsaga.repairs order by created_at`)
	require.NoError(t, err)
	for rows.Next() {
		var b string
		require.NoError(t, rows.Scan(&b))
		by = append(by, b)
	}
	require.NoError(t, rows.Err())
	d := sha256.Sum256([]byte("bare-token-0123456789"))
	require.Equal(t, []string{"http:alice", "http:token-" + hex.EncodeToString(d[:4])}, by)
	var got httpapi.Saga
	require.NoError(t, json.Unmarshal(grafana.do(t, http.MethodGet, sagaPath, nil, "").body, &got))
	require.Len(t, got.Repairs, 2)
	require.Equal(t, "http:alice", *got.Repairs[0].By)

	// Each token can ask who it is.
	var me httpapi.Caller
	require.NoError(t, json.Unmarshal(refunds.do(t, http.MethodGet, "/v1/whoami", nil, "").body, &me))
	require.Equal(t, httpapi.Caller{Authenticated: true, Name: "refunds", Scope: "operator", Definitions: []string{"refund"}, SeesPayloads: true}, me)
	require.NoError(t, json.Unmarshal(grafana.do(t, http.MethodGet, "/v1/whoami", nil, "").body, &me))
	require.Equal(t, httpapi.Caller{Authenticated: true, Name: "grafana", Scope: "read", SeesPayloads: false}, me)

	// A read token sees what happened, not what the saga carried.
	require.True(t, got.PayloadsRedacted)
	require.Equal(t, "null", string(got.Input))
	require.Nil(t, got.Results)
	raw := string(grafana.do(t, http.MethodGet, sagaPath, nil, "").body)
	require.NotContains(t, raw, `"amount"`, "no input member reaches a read token")
	var full httpapi.Saga
	require.NoError(t, json.Unmarshal(web.do(t, http.MethodGet, sagaPath, nil, "").body, &full))
	require.False(t, full.PayloadsRedacted)
	require.JSONEq(t, `{"account":4,"amount":40}`, string(full.Input), "a start token reads its sagas' data")
}
