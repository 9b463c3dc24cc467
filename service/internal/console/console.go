// Package console serves the web console of a deployment: one page of
// plain HTML, CSS and JavaScript, embedded in the binary, that lists
// sagas with their counts by state, shows one saga's timeline, sends the
// repairs of the HTTP API, lists the schedules with their pause and
// resume and the event dead letters, and plots the live figures of GET
// /v1/stats.
//
// The runtime's run command mounts it beside the API:
//
//	mux.Handle("/v1/", api)
//	mux.Handle("/ui/", console.Handler())
//
// The files hold no data, so they are served without a token. Everything
// the page shows it reads from /v1 on the same origin; with API tokens
// configured the page asks for one, keeps it in the tab's sessionStorage,
// and sends it as Authorization: Bearer on every request, so the API's
// authentication guards the console's data. Nothing is fetched from any
// other origin: a Content-Security-Policy of 'self' forbids it.
package console

import (
	"embed"
	"io/fs"
	"net/http"
	"strconv"
	"strings"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

//go:embed static
var static embed.FS

// Prefix is the path the console is served under.
const Prefix = "/ui/"

// securityPolicy lets the page load its own files and talk to its own
// origin only, and refuses to be framed.
const securityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; " +
	"frame-ancestors 'none'; base-uri 'none'; form-action 'none'"

// Handler serves the console's files under Prefix (/ui/): mount it with
// mux.Handle(console.Prefix, console.Handler()); the mux then redirects
// /ui to /ui/. It answers GET and HEAD only.
func Handler() http.Handler {
	files, err := fs.Sub(static, "static")
	if err != nil { // cannot happen: the directory is embedded
		panic(err)
	}
	fileServer := http.StripPrefix(strings.TrimSuffix(Prefix, "/"), http.FileServerFS(files))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			httpapi.WriteProblem(w, http.StatusMethodNotAllowed, httpapi.ProblemMethodNotAllowed, "Method not allowed",
				"the console's files are read with GET or HEAD")
			return
		}
		h := w.Header()
		h.Set("Content-Security-Policy", securityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		// The files change with the binary, which embeds no modification
		// time: ask the browser to check every time.
		h.Set("Cache-Control", "no-cache")
		fileServer.ServeHTTP(&problemWriter{ResponseWriter: w, path: r.URL.Path}, r)
	})
}

// problemWriter turns the file server's plain-text errors (a file that
// is not there) into problem bodies, as the API answers.
type problemWriter struct {
	http.ResponseWriter
	path    string
	swallow bool
}

func (p *problemWriter) WriteHeader(status int) {
	if status < http.StatusBadRequest {
		p.ResponseWriter.WriteHeader(status)
		return
	}
	p.swallow = true
	p.Header().Del("Content-Length")
	p.Header().Del("X-Content-Type-Options")
	typ, title := httpapi.ProblemNotFound, "Not found"
	detail := "the console has no file " + strconv.Quote(p.path) + "; open " + Prefix
	if status != http.StatusNotFound {
		typ, title, detail = httpapi.ProblemInternal, http.StatusText(status), "the console could not serve "+strconv.Quote(p.path)
	}
	p.Header().Set("X-Content-Type-Options", "nosniff")
	httpapi.WriteProblem(p.ResponseWriter, status, typ, title, detail)
}

func (p *problemWriter) Write(b []byte) (int, error) {
	if p.swallow {
		return len(b), nil // the file server's text, replaced by the problem
	}
	return p.ResponseWriter.Write(b)
}
