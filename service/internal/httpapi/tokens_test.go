package httpapi_test

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

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
