package httpapi_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// hostile are path parameters and query values no route may pass to SQL
// as they are, or answer with a 500.
var hostile = []string{"a\x00b", "\x00", "\xff\xfe", "caf\xc3", "%00", "' or 1=1 --", strings.Repeat("k", 5000), "..", "%2F", "🙂", " ", ""}

// FuzzRouter sends every route, each parameter replaced by a hostile
// value (and the list's filters too), and checks that the answer is never
// a server error and always a JSON body: a problem for a refusal. Its
// seeds run in the normal suite; `go test -fuzz FuzzRouter` explores.
func FuzzRouter(f *testing.F) {
	param := regexp.MustCompile(`\{[a-z]+\}`)
	for _, p := range httpapi.Patterns() {
		method, path, _ := strings.Cut(p, " ")
		for _, v := range hostile {
			f.Add(method, param.ReplaceAllString(path, url.PathEscape(v)), "")
		}
	}
	for _, name := range []string{"definition", "state", "limit", "cursor", "a\x00"} {
		for _, v := range hostile {
			f.Add(http.MethodGet, "/v1/sagas", url.Values{name: {v}}.Encode())
		}
	}
	f.Add(http.MethodGet, "/v1/nowhere", "")
	e := newEnv(f, func(c *httpapi.Config) { c.Gatherer = prometheus.NewRegistry() })
	f.Fuzz(func(t *testing.T, method, path, query string) {
		// What cannot be a request line net/http's server reads (it
		// answers those itself, before any route) is not the router's.
		raw := func(s string) bool {
			return strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r >= 0x7f })
		}
		if !strings.HasPrefix(path, "/v1/") || strings.ContainsAny(path, "?#") || raw(path) || raw(query) || !validMethod(method) {
			t.Skip()
		}
		u := path
		if query != "" {
			u += "?" + query
		}
		r, err := e.send(method, u, startHeaders("fuzz"), `{}`)
		if err != nil {
			t.Skip() // a request Go's client will not send
		}
		require.Less(t, r.status, 500, "%s %s: %s", method, u, r.body)
		ct := r.header.Get("Content-Type")
		require.True(t, ct == httpapi.ProblemContentType || ct == "application/json", "%s %s: %s %s", method, u, ct, r.body)
	})
}

func validMethod(m string) bool {
	switch m {
	case http.MethodGet, http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch:
		return true
	}
	return false
}

// TestUnknownRouteNamesEveryRoute: the 404 of a path no route serves
// lists every path the API serves, and a NUL in a parameter is a 400
// that names it.
func TestUnknownRouteNamesEveryRoute(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.do(t, http.MethodGet, "/v1/nowhere", nil, "")
	require.Equal(t, http.StatusNotFound, r.status)
	detail := r.problem(t).Detail
	for _, p := range httpapi.Patterns() {
		_, path, _ := strings.Cut(p, " ")
		require.Contains(t, detail, path)
	}
	r = e.do(t, http.MethodPost, "/v1/sagas/pay%00out", startHeaders("nul"), `{"account":1,"amount":5}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.problem(t).Detail, `"/v1/sagas/pay\x00out"`)
	e.nothingWritten(t)
}
