package console_test

import (
	"context"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/service/internal/console"
)

func TestMain(m *testing.M) { testenv.Main(m, migrateLedger) }

// migrateLedger creates the table the browser test's saga writes to.
func migrateLedger(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, `create schema console_test;
create table console_test.ledger (
  saga_id uuid not null,
  step text not null,
  phase text not null,
  amount bigint not null,
  primary key (saga_id, step, phase)
)`)
	return err
}

func get(t *testing.T, srv *httptest.Server, method, path string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, nil)
	require.NoError(t, err)
	res, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res, string(b)
}

// TestHandler serves the page and its files with a policy that keeps it
// on its own origin, redirects /ui to /ui/, and answers GET and HEAD only.
func TestHandler(t *testing.T) {
	t.Parallel()
	mux := http.NewServeMux()
	mux.Handle(console.Prefix, console.Handler())
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	srv.Client().CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	for path, typ := range map[string]string{"/ui/": "text/html", "/ui/main.js": "text/javascript", "/ui/saga.js": "text/javascript", "/ui/schedules.js": "text/javascript", "/ui/events.js": "text/javascript", "/ui/bulk.js": "text/javascript", "/ui/definitions.js": "text/javascript", "/ui/live.js": "text/javascript", "/ui/console.css": "text/css"} {
		res, body := get(t, srv, http.MethodGet, path)
		require.Equal(t, http.StatusOK, res.StatusCode, path)
		require.Contains(t, res.Header.Get("Content-Type"), typ, path)
		require.Contains(t, res.Header.Get("Content-Security-Policy"), "default-src 'none'", path)
		require.Contains(t, res.Header.Get("Content-Security-Policy"), "connect-src 'self'", path)
		require.Equal(t, "nosniff", res.Header.Get("X-Content-Type-Options"), path)
		require.Equal(t, "DENY", res.Header.Get("X-Frame-Options"), path)
		require.NotEmpty(t, body, path)
	}
	_, body := get(t, srv, http.MethodGet, "/ui/")
	require.Contains(t, body, `<script type="module" src="main.js">`)

	res, _ := get(t, srv, http.MethodGet, "/ui")
	require.Equal(t, http.StatusTemporaryRedirect, res.StatusCode)
	require.Equal(t, "/ui/", res.Header.Get("Location"))

	// Refusals are problem bodies, as the API's are.
	res, body = get(t, srv, http.MethodGet, "/ui/nothing.js")
	require.Equal(t, http.StatusNotFound, res.StatusCode)
	require.Equal(t, "application/problem+json", res.Header.Get("Content-Type"))
	require.JSONEq(t, `{"type":"urn:idemsaga:problem:not-found","title":"Not found","status":404,"detail":"the console has no file \"/ui/nothing.js\"; open /ui/"}`, body)

	res, body = get(t, srv, http.MethodPost, "/ui/")
	require.Equal(t, http.StatusMethodNotAllowed, res.StatusCode)
	require.Equal(t, "GET, HEAD", res.Header.Get("Allow"))
	require.Equal(t, "application/problem+json", res.Header.Get("Content-Type"))
	require.Contains(t, body, "GET or HEAD")

	res, body = get(t, srv, http.MethodHead, "/ui/main.js")
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Empty(t, body)
}

// TestNothingFromElsewhere: the files name no other origin, so the page
// works on a machine without internet and leaks nothing to a CDN.
func TestNothingFromElsewhere(t *testing.T) {
	t.Parallel()
	remote := regexp.MustCompile(`(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}|@import|<iframe`)
	err := filepath.WalkDir("static", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range remote.FindAllString(string(b), -1) {
			// The one namespace URI SVG elements need is not fetched.
			if strings.HasSuffix(m, "www.w3.org") {
				continue
			}
			t.Errorf("%s refers to %q; the console must load nothing from elsewhere", path, m)
		}
		return nil
	})
	require.NoError(t, err)
}
