package httpapi

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// Defaults of Config.
const (
	// MaxBodyBytesDefault bounds a request body: a transfer is three
	// numbers.
	MaxBodyBytesDefault = 16 << 10
	// KeyTTLDefault keeps a stored answer for 7 days, longer than any
	// client's retry window.
	KeyTTLDefault = 7 * 24 * time.Hour
	// ClaimTimeoutDefault is how long a request may hold its key before
	// the claim counts as abandoned.
	ClaimTimeoutDefault = time.Minute
)

// Config configures the handler returned by New. Pool, Client and
// Definition are required.
type Config struct {
	// Pool is the database holding the engine's tables, migrated to
	// include idemsaga.http_idempotency. Required.
	Pool *pgxpool.Pool
	// Client starts and reads sagas. It must use the same database as
	// Pool and have Definition among its definitions. Required.
	Client *engine.Client
	// Definition is the transfer saga (examples/transfer) that POST
	// /transfers starts. Required.
	Definition *saga.Definition
	// MaxBodyBytes bounds a request body; a larger one is refused with
	// 413. Defaults to MaxBodyBytesDefault.
	MaxBodyBytes int64
	// KeyTTL is how long the answer to a request is kept for replay under
	// its Idempotency-Key. After it, the key may be claimed anew; the
	// saga's own unique key still returns the same saga for the same body
	// and refuses a different one. Expired rows are not deleted yet (no
	// cleaner runs); they are overwritten when their key is used again.
	// Defaults to KeyTTLDefault; it must exceed ClaimTimeout.
	KeyTTL time.Duration
	// ClaimTimeout is how long a request may hold its Idempotency-Key
	// without answering before another request with the same key and body
	// takes it over (the first request's process crashed, say). Handling a
	// request is bounded by half of it. Defaults to ClaimTimeoutDefault.
	ClaimTimeout time.Duration
	// Logger receives server-side failures. Defaults to slog.Default().
	Logger *slog.Logger
}

func (c *Config) validate() error {
	switch {
	case c.Pool == nil:
		return errors.New("httpapi: Config.Pool is required: pass the pool the engine uses")
	case c.Client == nil:
		return errors.New("httpapi: Config.Client is required: use engine.NewClient or Engine.Client")
	case c.Definition == nil:
		return errors.New("httpapi: Config.Definition is required: pass the transfer saga's definition")
	case c.MaxBodyBytes < 0:
		return errors.New("httpapi: Config.MaxBodyBytes must not be negative; leave it 0 for the default")
	case c.KeyTTL < 0:
		return errors.New("httpapi: Config.KeyTTL must not be negative; leave it 0 for the default")
	case c.ClaimTimeout < 0:
		return errors.New("httpapi: Config.ClaimTimeout must not be negative; leave it 0 for the default")
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = MaxBodyBytesDefault
	}
	if c.KeyTTL == 0 {
		c.KeyTTL = KeyTTLDefault
	}
	if c.ClaimTimeout == 0 {
		c.ClaimTimeout = ClaimTimeoutDefault
	}
	if c.ClaimTimeout < 2*time.Millisecond {
		return errors.New("httpapi: Config.ClaimTimeout must be at least 2ms")
	}
	if c.KeyTTL <= c.ClaimTimeout {
		return errors.New("httpapi: Config.KeyTTL must exceed Config.ClaimTimeout, or a claim could expire while its request runs")
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// handler serves the routes.
type handler struct {
	cfg  Config
	keys *keyStore
}

// New returns the HTTP API:
//
//	POST /transfers        start a transfer saga (Idempotency-Key required)
//	GET  /transfers/{id}   the saga's state and step timeline
//
// Mount it at the root of a server, or on a mux with both "/transfers"
// and "/transfers/" routed to it: Location headers are absolute paths.
func New(cfg Config) (http.Handler, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	h := &handler{cfg: cfg, keys: &keyStore{pool: cfg.Pool, ttl: cfg.KeyTTL, claimTimeout: cfg.ClaimTimeout}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /transfers", h.postTransfer)
	mux.HandleFunc("GET /transfers/{id}", h.getTransfer)
	return mux, nil
}

// StartAnswer is the body of a successful POST /transfers.
type StartAnswer struct {
	// ID identifies the saga; GET /transfers/{id} reads it.
	ID uuid.UUID `json:"id"`
	// Key is the Idempotency-Key, which is also the saga's key.
	Key string `json:"key"`
	// State is the saga's state when the request was first answered. A
	// replay repeats it unchanged; read the current state with GET.
	State saga.State `json:"state"`
	// Duplicate is true when the key already named a saga with the same
	// input, started through another channel (the CLI, say) or before the
	// stored answer expired: no saga was created.
	Duplicate bool `json:"duplicate"`
}

// Transfer is the body of GET /transfers/{id}.
type Transfer struct {
	// ID identifies the saga.
	ID uuid.UUID `json:"id"`
	// Key is the idempotency key the saga was started with.
	Key string `json:"key"`
	// State is the saga's current state: init, deducted, credited, or
	// compensating, compensated, failed.
	State saga.State `json:"state"`
	// Finished is true once State is terminal.
	Finished bool `json:"finished"`
	// Input is the saga's input: {"amount":…,"from":…,"to":…}.
	Input json.RawMessage `json:"input"`
	// Results holds each completed forward step's result by step name.
	Results map[string]json.RawMessage `json:"results"`
	// Error says why the saga compensated or failed.
	Error string `json:"error,omitempty"`
	// CreatedAt is when the saga started.
	CreatedAt time.Time `json:"created_at"`
	// UpdatedAt is when its state last changed.
	UpdatedAt time.Time `json:"updated_at"`
	// FinishedAt is when it reached a terminal state.
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// Steps is the timeline: one entry per step execution (step and
	// phase), in the order they were dispatched.
	Steps []Step `json:"steps"`
}

// Step is one step execution of a Transfer's timeline: a (step, phase)
// pair with its latest attempt.
type Step struct {
	// Step is the step's name: deduct, credit.
	Step string `json:"step"`
	// Phase is forward or compensate.
	Phase saga.Phase `json:"phase"`
	// Status is dispatched, retrying, succeeded or failed.
	Status saga.StepStatus `json:"status"`
	// Attempt is the latest attempt's number, from 1.
	Attempt int `json:"attempt"`
	// Key is the step key, the same on every attempt.
	Key uuid.UUID `json:"key"`
	// LastError is the latest attempt's error.
	LastError string `json:"last_error,omitempty"`
	// Result is the step's result once it succeeded.
	Result json.RawMessage `json:"result,omitempty"`
	// LeaseUntil is when a dispatched attempt is given up.
	LeaseUntil *time.Time `json:"lease_until,omitempty"`
	// NextAttemptAt is when a retrying step is dispatched again.
	NextAttemptAt *time.Time `json:"next_attempt_at,omitempty"`
	// CreatedAt is when the step was first dispatched.
	CreatedAt time.Time `json:"created_at"`
	// UpdatedAt is when its status last changed.
	UpdatedAt time.Time `json:"updated_at"`
}

func (h *handler) getTransfer(w http.ResponseWriter, r *http.Request) {
	raw := r.PathValue("id")
	id, err := uuid.Parse(raw)
	if err != nil {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemInvalidID, "Invalid transfer ID",
			"the path must end in the transfer's ID, a UUID such as the \"id\" POST /transfers returned"))
		return
	}
	sg, err := h.cfg.Client.Get(r.Context(), id)
	if errors.Is(err, saga.ErrNotFound) || (err == nil && sg.Definition != h.cfg.Definition.Name()) {
		writeProblem(w, newProblem(http.StatusNotFound, ProblemNotFound, "Transfer not found",
			"no transfer has ID "+id.String()+"; check the ID POST /transfers returned"))
		return
	}
	if err != nil {
		h.internal(w, r, "read the transfer", "retry later", err, "id", id)
		return
	}
	t := Transfer{
		ID: sg.ID, Key: sg.Key, State: sg.State, Finished: sg.Finished(), Input: sg.Input, Results: sg.Results,
		Error: sg.Error, CreatedAt: sg.CreatedAt, UpdatedAt: sg.UpdatedAt, FinishedAt: sg.FinishedAt,
		Steps: make([]Step, 0, len(sg.Steps)),
	}
	if t.Results == nil {
		t.Results = map[string]json.RawMessage{}
	}
	for _, s := range sg.Steps {
		t.Steps = append(t.Steps, Step{
			Step: s.Step, Phase: s.Phase, Status: s.Status, Attempt: s.Attempt, Key: s.Key, LastError: s.LastError,
			Result: s.Result, LeaseUntil: s.LeaseUntil, NextAttemptAt: s.NextAttemptAt,
			CreatedAt: s.CreatedAt, UpdatedAt: s.UpdatedAt,
		})
	}
	body, err := json.Marshal(t)
	if err != nil {
		h.internal(w, r, "encode the transfer", "retry later", err, "id", id)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(append(body, '\n'))
}

// internal logs a server-side failure and answers 500 with detail.
func (h *handler) internal(w http.ResponseWriter, r *http.Request, what, detail string, err error, args ...any) {
	h.cfg.Logger.ErrorContext(r.Context(), "http api: "+what+" failed",
		append([]any{"method", r.Method, "path", r.URL.Path, "error", err}, args...)...)
	writeProblem(w, newProblem(http.StatusInternalServerError, ProblemInternal, "Internal server error",
		"the server could not "+what+"; "+detail))
}
