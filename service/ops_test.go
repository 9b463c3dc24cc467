package service

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestProblemsOutsideTheAPI: a path no route of the server takes, or a
// method a route does not serve, is answered with a problem body, as the
// API answers its own (POST /metrics was a plain-text 405, /debug/pprof/
// a plain-text 404).
func TestProblemsOutsideTheAPI(t *testing.T) {
	t.Parallel()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	h := problemsOutside(mux)
	for _, tc := range []struct {
		method, path string
		status       int
		allow, typ   string
	}{
		{http.MethodPost, "/metrics", http.StatusMethodNotAllowed, "GET, HEAD", "urn:idemsaga:problem:method-not-allowed"},
		{http.MethodGet, "/debug/pprof/", http.StatusNotFound, "", "urn:idemsaga:problem:not-found"},
		{http.MethodGet, "/", http.StatusNotFound, "", "urn:idemsaga:problem:not-found"},
	} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, nil))
		require.Equal(t, tc.status, rec.Code, tc.path)
		require.Equal(t, "application/problem+json", rec.Header().Get("Content-Type"), tc.path)
		require.Equal(t, tc.allow, rec.Header().Get("Allow"), tc.path)
		var p struct {
			Type   string `json:"type"`
			Status int    `json:"status"`
			Detail string `json:"detail"`
		}
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &p), rec.Body.String())
		require.Equal(t, tc.typ, p.Type)
		require.Equal(t, tc.status, p.Status)
		require.Contains(t, p.Detail, tc.path)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, "ok", rec.Body.String(), "a route that serves is served")
}
