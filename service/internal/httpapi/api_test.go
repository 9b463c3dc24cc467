package httpapi_test

import (
	"bytes"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestRoutingProblems: unknown paths and wrong methods under /v1 answer
// problems, not the mux's plain text.
func TestRoutingProblems(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, path := range []string{"/v1/", "/v1/nothing", "/v1/sagas/", "/v1/sagas/a/b", "/v1/sagas/a/cancel/x"} {
		r := e.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusNotFound, r.status, path)
		require.Equal(t, httpapi.ProblemNotFound, r.problem(t).Type, path)
	}
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodDelete, "/v1/sagas/payout", "GET, HEAD, POST"},
		{http.MethodPut, "/v1/sagas", "GET, HEAD"},
		{http.MethodPost, "/v1/sagas", "GET, HEAD"},
		{http.MethodGet, "/v1/sagas/x/cancel", "POST"},
		{http.MethodPatch, "/v1/sagas/x/retry", "POST"},
	} {
		r := e.do(t, c.method, c.path, nil, "")
		require.Equal(t, http.StatusMethodNotAllowed, r.status, c.path)
		require.Equal(t, c.allow, r.header.Get("Allow"), c.path)
		require.Equal(t, httpapi.ProblemMethodNotAllowed, r.problem(t).Type, c.path)
	}
}

// TestConfig refuses a config without its required fields.
func TestConfig(t *testing.T) {
	t.Parallel()
	_, err := httpapi.New(httpapi.Config{})
	require.ErrorContains(t, err, "Config.Client")
	e := newEnv(t)
	_, err = httpapi.New(httpapi.Config{Client: e.client, RequestTimeout: -1})
	require.ErrorContains(t, err, "Config.RequestTimeout")
}

const (
	goodToken  = "s3cret-token-0123456789"
	otherToken = "another-token-abcdefghij"
)

// TestAuth: with tokens, a request without one of them is 401 and starts
// nothing; one of them works; nothing of a token reaches the log.
func TestAuth(t *testing.T) {
	t.Parallel()
	tokens, err := httpapi.ParseTokens("# API tokens\n" + goodToken + "\n\n  " + otherToken + "  \r\n")
	require.NoError(t, err)
	require.Equal(t, 2, tokens.Len())
	var logs bytes.Buffer
	e := newEnv(t, func(c *httpapi.Config) {
		c.Tokens = tokens
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	body := `{"account":1,"amount":5}`
	refused := []struct {
		name  string
		auth  []string
		error bool // error="invalid_token"
	}{
		{"none", nil, false},
		{"wrong token", []string{"Bearer " + goodToken + "x"}, true},
		{"prefix of a token", []string{"Bearer " + goodToken[:len(goodToken)-1]}, true},
		{"other scheme", []string{"Basic " + goodToken}, false},
		{"no token", []string{"Bearer "}, false},
		{"twice", []string{"Bearer " + goodToken, "Bearer " + goodToken}, false},
	}
	for _, c := range refused {
		headers := startHeaders("auth-1")
		for _, a := range c.auth {
			headers = append(headers, hdr{"Authorization", a})
		}
		for _, req := range []struct{ method, path string }{{http.MethodPost, "/v1/sagas/payout"}, {http.MethodGet, "/v1/sagas"}, {http.MethodGet, "/v1/nothing"}} {
			r := e.do(t, req.method, req.path, headers, body)
			require.Equal(t, http.StatusUnauthorized, r.status, "%s %s %s: %s", c.name, req.method, req.path, r.body)
			require.True(t, strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer"), c.name)
			require.Equal(t, c.error, strings.Contains(r.header.Get("WWW-Authenticate"), `error="invalid_token"`), c.name)
			p := r.problem(t)
			require.Equal(t, httpapi.ProblemUnauthorized, p.Type)
			require.NotContains(t, string(r.body), goodToken[:8])
		}
	}
	e.nothingWritten(t)

	e.token = otherToken
	r := e.start(t, "auth-1", body)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	e.token = goodToken
	r = e.do(t, http.MethodGet, "/v1/sagas", []hdr{{"Authorization", "bearer " + goodToken}}, "")
	require.Equal(t, http.StatusUnauthorized, r.status, "two Authorization headers")
	r = e.do(t, http.MethodGet, "/v1/sagas", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)

	// A failure is logged without the request's headers.
	e.pool.Close()
	r = e.start(t, "auth-2", body)
	require.Equal(t, http.StatusInternalServerError, r.status, "body: %s", r.body)
	require.Equal(t, httpapi.ProblemInternal, r.problem(t).Type)
	require.Contains(t, r.problem(t).Detail, "retrying with the same Idempotency-Key is safe")
	require.NotEmpty(t, logs.String())
	require.NotContains(t, logs.String(), goodToken[:8])
	require.NotContains(t, logs.String(), "Authorization")
}

// TestNoTokens: a nil or empty Tokens serves /v1 without authentication.
func TestNoTokens(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *httpapi.Config) { c.Tokens = &httpapi.Tokens{} })
	require.Equal(t, http.StatusOK, e.do(t, http.MethodGet, "/v1/sagas", nil, "").status)
}
