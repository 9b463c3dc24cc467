package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/engine"
)

// Defaults of Config.
const (
	// MaxBodyBytesDefault bounds a request body: the engine's default
	// bound of a saga input.
	MaxBodyBytesDefault = engine.MaxInputBytesDefault
	// RequestTimeoutDefault bounds the work of one request.
	RequestTimeoutDefault = 10 * time.Second
)

// Config configures the handler New returns. Client is required.
type Config struct {
	// Client starts, reads and repairs sagas. Required.
	Client *engine.Client
	// Tokens are the bearer tokens /v1 requires. Nil or empty: no
	// authentication.
	Tokens *Tokens
	// MaxBodyBytes bounds a request body; a larger one is refused with
	// 413. Defaults to MaxBodyBytesDefault.
	MaxBodyBytes int64
	// RequestTimeout bounds each request's work, and so how long a start
	// holds its key's lock. Defaults to RequestTimeoutDefault.
	RequestTimeout time.Duration
	// Logger receives server-side failures. Defaults to slog.Default().
	Logger *slog.Logger
	// SubmitTokenTTL is the time to live of a submit token issued by POST
	// /v1/tokens without "ttl_seconds". Defaults to
	// engine.SubmitTokenTTLDefault.
	SubmitTokenTTL time.Duration
	// MaxSubmitTokenTTL is the longest time to live a POST /v1/tokens may
	// ask for, at most engine.MaxSubmitTokenTTL. Defaults to
	// engine.MaxSubmitTokenTTL.
	MaxSubmitTokenTTL time.Duration
	// Gatherer holds the engine's metrics (the Registry its Registerer
	// is), read by GET /v1/stats. Defaults to none: /v1/stats answers
	// 501.
	Gatherer prometheus.Gatherer
	// TraceRequests makes a start continue the trace named by its
	// request's W3C traceparent header, when the client traces
	// (engine.Config.TracerProvider). Defaults to off: the start's span,
	// if any, begins a trace.
	TraceRequests bool
	// ShedFunc, if set, is asked before each saga start whether to refuse
	// it under overload (Engine.ShedStart): an error refuses it with 503,
	// a Retry-After and nothing written; an *engine.Overload's RetryAfter
	// sets the header. Callbacks, repairs and reads are never shed: they
	// drain work. Defaults to nil: nothing is shed.
	ShedFunc func(ctx context.Context, definition string) error
}

func (c *Config) validate() error {
	switch {
	case c.Client == nil:
		return errors.New("httpapi: Config.Client is required: use Engine.Client or engine.NewClient")
	case c.MaxBodyBytes < 0:
		return errors.New("httpapi: Config.MaxBodyBytes must not be negative; leave it 0 for the default")
	case c.RequestTimeout < 0:
		return errors.New("httpapi: Config.RequestTimeout must not be negative; leave it 0 for the default")
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = MaxBodyBytesDefault
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = RequestTimeoutDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxSubmitTokenTTL == 0 {
		c.MaxSubmitTokenTTL = engine.MaxSubmitTokenTTL
	}
	if c.SubmitTokenTTL == 0 {
		c.SubmitTokenTTL = min(engine.SubmitTokenTTLDefault, c.MaxSubmitTokenTTL)
	}
	switch {
	case c.MaxSubmitTokenTTL < engine.MinSubmitTokenTTL || c.MaxSubmitTokenTTL > engine.MaxSubmitTokenTTL:
		return fmt.Errorf("httpapi: Config.MaxSubmitTokenTTL is %s, outside %s to %s; leave it 0 for %s", c.MaxSubmitTokenTTL, engine.MinSubmitTokenTTL, engine.MaxSubmitTokenTTL, engine.MaxSubmitTokenTTL)
	case c.SubmitTokenTTL < engine.MinSubmitTokenTTL || c.SubmitTokenTTL > c.MaxSubmitTokenTTL:
		return fmt.Errorf("httpapi: Config.SubmitTokenTTL is %s, outside %s to MaxSubmitTokenTTL (%s); leave it 0 for %s", c.SubmitTokenTTL, engine.MinSubmitTokenTTL, c.MaxSubmitTokenTTL, engine.SubmitTokenTTLDefault)
	case c.SubmitTokenTTL%time.Second != 0:
		return fmt.Errorf("httpapi: Config.SubmitTokenTTL is %s; give whole seconds, as a request's ttl_seconds", c.SubmitTokenTTL)
	}
	return nil
}

// api serves the routes.
type api struct {
	cfg Config
	mux *http.ServeMux
	// paths lists the routes' paths, for the 404 of a path none serves.
	paths string
	// document is the OpenAPI document of the routes.
	document []byte
}

// New returns the HTTP API for every saga definition Client knows or the
// deployment recorded. It serves paths under /v1/: mount it with
// mux.Handle("/v1/", h). With Config.Tokens, every request needs one of
// them (Tokens.Require).
func New(cfg Config) (http.Handler, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	a := &api{cfg: cfg, mux: http.NewServeMux()}
	var paths []string
	for _, rt := range a.routes() {
		a.mux.HandleFunc(rt.pattern, func(w http.ResponseWriter, r *http.Request) {
			if permits(w, r, rt.scope) {
				rt.handler(w, r)
			}
		})
		_, path, _ := strings.Cut(rt.pattern, " ")
		if !slices.Contains(paths, path) {
			paths = append(paths, path)
		}
	}
	a.paths = strings.Join(paths, ", ")
	doc, err := openAPI(a.routes())
	if err != nil {
		return nil, fmt.Errorf("httpapi: the OpenAPI document: %w", err)
	}
	a.document = doc
	var h http.Handler = a
	if cfg.Tokens.Len() > 0 {
		h = cfg.Tokens.Require(h)
	}
	return h, nil
}

// route is one pattern the API serves, its handler, and what the OpenAPI
// document says of it.
type route struct {
	pattern string
	// scope is the least scope a token needs for the route.
	scope   Scope
	handler http.HandlerFunc
	doc     opDoc
}

// routes are every route of the API: the mux and the OpenAPI document
// are both made from them.
func (a *api) routes() []route {
	reason := obj("reason", str("Why, recorded with the repair."))
	return []route{
		{"POST /v1/sagas/{definition}", ScopeStart, a.start, opDoc{"Start a saga of a definition under the request's Idempotency-Key (201; the same key and input again: 200, the same saga).",
			map[string]any{"description": "The saga's input, checked by the definition's input rules."}, Started{}, http.StatusCreated, true, nil}},
		{"GET /v1/sagas/{id}", ScopeRead, a.get, opDoc{"Read a saga: its state, steps, attempts, repairs, callbacks, parent, children and plan.", nil, Saga{}, http.StatusOK, false, nil}},
		{"GET /v1/sagas", ScopeRead, a.list, opDoc{"List sagas, newest first, with their counts by state.", nil, List{}, http.StatusOK, false,
			[]string{"definition", "state", "key", "created_from", "created_before", "stuck", "dead_lettered", "paused", "waiting", "order", "limit", "cursor"}}},
		{"POST /v1/sagas/{id}/cancel", ScopeOperator, a.cancel, opDoc{"Cancel a running, parked or failed saga: what it did is compensated.", reason, Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/sagas/{id}/retry", ScopeOperator, a.retry, opDoc{"Run a failed or parked saga's step (or a step waiting out a backoff) again under its key.", reason, Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/sagas/{id}/skip", ScopeOperator, a.skip, opDoc{"Mark a step succeeded with the result the other system gave, and go on.",
			obj("step", str("The step to skip."), "result", map[string]any{"description": "The step's result, as JSON."}, "reason", str("Why.")), Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/sagas/{id}/close", ScopeOperator, a.close, opDoc{"Close a failed or parked saga as handled by hand.", reason, Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/sagas/{id}/pause", ScopeOperator, a.pause, opDoc{"Start no attempt of the saga until it is resumed.", reason, Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/sagas/{id}/resume", ScopeOperator, a.resume, opDoc{"Let a paused saga run again.", reason, Repaired{}, http.StatusOK, true, nil}},
		{"POST /v1/repairs", ScopeOperator, a.bulk, opDoc{"Repair every saga a filter selects (a dry run first says what would change).",
			obj("operation", str("retry, cancel, skip, close, pause or resume."), "filter", obj("definition", str(""), "state", str("")),
				"limit", map[string]any{"type": "integer"}, "cursor", str(""), "dry_run", map[string]any{"type": "boolean"}, "reason", str(""),
				"step", str("A skip's step."), "result", map[string]any{"description": "A skip's result."}), BulkRepaired{}, http.StatusOK, true, nil}},
		{"POST /v1/callbacks/{token}", ScopeStart, a.callback, opDoc{"Answer a callback step (the token names the saga and step), once per event id.",
			obj("event_id", str("The event's id: a repeat is answered from its record."), "result", map[string]any{"description": "The step's result."}, "error", str("A refusal: the step fails for good.")),
			Completed{}, http.StatusOK, false, nil}},
		{"POST /v1/tokens", ScopeStart, a.issueToken, opDoc{"Issue a submit token: the Idempotency-Key of one start of a definition.",
			obj("definition", str(""), "ttl_seconds", map[string]any{"type": "integer", "minimum": 60, "maximum": 86400}), SubmitToken{}, http.StatusCreated, false, nil}},
		{"GET /v1/definitions", ScopeRead, a.definitions, opDoc{"List the definitions the deployment recorded, their steps, states and pauses.", nil, Definitions{}, http.StatusOK, false, nil}},
		{"POST /v1/definitions/{definition}/pause", ScopeOperator, a.pauseDefinition, opDoc{"Pause every saga of a definition.", reason, engine.DefinitionRepair{}, http.StatusOK, true, nil}},
		{"POST /v1/definitions/{definition}/resume", ScopeOperator, a.resumeDefinition, opDoc{"Lift a definition's pause.", reason, engine.DefinitionRepair{}, http.StatusOK, true, nil}},
		{"GET /v1/stats", ScopeRead, a.stats, opDoc{"This process's figures, for the console's live view.", nil, Stats{}, http.StatusOK, false, nil}},
		{"GET /v1/schedules", ScopeRead, a.schedules, opDoc{"List the schedules, their last ticks and pauses.", nil, Schedules{}, http.StatusOK, false, nil}},
		{"POST /v1/schedules/{definition}/pause", ScopeOperator, a.pauseSchedule, opDoc{"Pause a schedule: no tick starts a saga until it is resumed.", reason, engine.ScheduleRepair{}, http.StatusOK, true, nil}},
		{"POST /v1/schedules/{definition}/resume", ScopeOperator, a.resumeSchedule, opDoc{"Resume a schedule.", reason, engine.ScheduleRepair{}, http.StatusOK, true, nil}},
		{"GET /v1/event-dead-letters", ScopeRead, a.eventDeadLetters, opDoc{"List the events that could not start a saga, with why.", nil, EventDeadLetters{}, http.StatusOK, false, nil}},
		{"GET /v1/whoami", ScopeRead, a.whoami, opDoc{"Who the bearer token is: its name (repairs are recorded under it), scope and definitions.", nil, Caller{}, http.StatusOK, false, nil}},
		{"GET /v1/openapi.json", ScopeRead, a.openAPIDocument, opDoc{"This document.", nil, nil, http.StatusOK, false, nil}},
	}
}

// malformedText says what part of r no route can take: a path segment or
// a query value that is not UTF-8 or holds a NUL byte (PostgreSQL stores
// neither in text), "" when none.
func malformedText(r *http.Request) string {
	bad := func(s string) bool { return !utf8.ValidString(s) || strings.ContainsRune(s, 0) }
	if bad(r.URL.Path) {
		return "the path " + strconv.Quote(r.URL.Path)
	}
	for name, vs := range r.URL.Query() {
		if bad(name) {
			return "the query parameter name " + strconv.Quote(name)
		}
		for _, v := range vs {
			if bad(v) {
				return "the query parameter " + strconv.Quote(name) + "'s value " + strconv.Quote(v)
			}
		}
	}
	return ""
}

// probeMethods are the methods tried to fill in a 405's Allow header.
var probeMethods = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions}

// ServeHTTP routes r, answering the mux's own 404 and 405 as problems.
func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if what := malformedText(r); what != "" {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Malformed request",
			what+" is not UTF-8 text, or holds a NUL byte; no definition, ID, key or filter can; send it as UTF-8 without NUL"))
		return
	}
	if _, pattern := a.mux.Handler(r); pattern != "" {
		a.mux.ServeHTTP(w, r)
		return
	}
	var allow []string
	for _, m := range probeMethods {
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, p := a.mux.Handler(probe); p != "" {
			allow = append(allow, m)
		}
	}
	if len(allow) == 0 {
		writeProblem(w, newProblem(http.StatusNotFound, ProblemNotFound, "Not found",
			"no route has the path "+strconv.Quote(r.URL.Path)+"; the API serves "+a.paths))
		return
	}
	slices.Sort(allow)
	w.Header().Set("Allow", strings.Join(allow, ", "))
	writeProblem(w, newProblem(http.StatusMethodNotAllowed, ProblemMethodNotAllowed, "Method not allowed",
		r.Method+" is not served on this path; it takes "+strings.Join(allow, ", ")))
}

// readContext bounds a read by RequestTimeout; it ends with the request.
func (a *api) readContext(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), a.cfg.RequestTimeout)
}

// writeContext bounds a write by RequestTimeout and not by the client: a
// write once begun finishes, or is rolled back, whether or not the client
// waits for its answer.
func (a *api) writeContext(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(r.Context()), a.cfg.RequestTimeout)
}

// writeJSON answers with status and body, with a trailing newline.
func writeJSON(w http.ResponseWriter, status int, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// encode marshals v and answers with it, or with 500.
func (a *api) encode(w http.ResponseWriter, r *http.Request, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		a.internal(w, r, "encode the answer", "retry later", err)
		return
	}
	writeJSON(w, status, body)
}

// internal logs a server-side failure (never a header) and answers 500.
func (a *api) internal(w http.ResponseWriter, r *http.Request, what, next string, err error, args ...any) {
	a.cfg.Logger.ErrorContext(r.Context(), "http api: could not "+what,
		append([]any{"method", r.Method, "path", r.URL.Path, "error", err}, args...)...)
	writeProblem(w, newProblem(http.StatusInternalServerError, ProblemInternal, "Internal server error",
		"the server could not "+what+"; "+next))
}
