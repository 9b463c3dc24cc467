package httpapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/planview"
)

// Bounds of GET /v1/sagas.
const (
	// ListLimitDefault is the page size when limit is not given.
	ListLimitDefault = 50
	// ListLimitMax is the largest limit.
	ListLimitMax = 500
)

// Summary is a saga without its input, results and steps: an entry of
// GET /v1/sagas.
type Summary struct {
	ID         uuid.UUID  `json:"id"`
	Definition string     `json:"definition"`
	Key        string     `json:"key"`
	State      saga.State `json:"state"`
	// Version counts the saga's transitions.
	Version int64 `json:"version"`
	// Error says why the saga compensated, failed or parked; null if not.
	Error      *string    `json:"error"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at"`
}

// Saga is the body of GET /v1/sagas/{id}.
type Saga struct {
	ID         uuid.UUID  `json:"id"`
	Definition string     `json:"definition"`
	Key        string     `json:"key"`
	State      saga.State `json:"state"`
	Version    int64      `json:"version"`
	// PayloadsRedacted is set when the token may read sagas but not their
	// data (scope read): the input, the results, the steps' results and
	// callback tokens, and the callbacks' results are null.
	PayloadsRedacted bool `json:"payloads_redacted,omitempty"`
	// Input is the saga's input as stored (canonical JSON).
	Input json.RawMessage `json:"input"`
	// Results holds each completed forward step's result by step name.
	Results map[string]json.RawMessage `json:"results"`
	Error   *string                    `json:"error"`
	// CreatedAt, UpdatedAt and FinishedAt are on the database's clock.
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at"`
	// Paused says why the saga is held (its own pause, or its
	// definition's), null while it runs.
	Paused *saga.Pause `json:"paused"`
	// DeadlineAt is when the saga is cancelled if it has not finished,
	// null for none.
	DeadlineAt *time.Time `json:"deadline_at"`
	// Steps lists the step executions, one per (step, phase).
	Steps []Step `json:"steps"`
	// Attempts is the timeline: every attempt of every step, in dispatch
	// order.
	Attempts []Attempt `json:"attempts"`
	// Repairs lists the operators' repairs of the saga, oldest first.
	Repairs []RepairRecord `json:"repairs"`
	// Callbacks lists the callbacks received for its callback steps, in
	// the order received.
	Callbacks []saga.CallbackRecord `json:"callbacks"`
	// DefinitionVersion is the version of the definition the saga runs.
	DefinitionVersion int `json:"definition_version"`
	// DeadLetters lists its commands parked because no worker that
	// received them could run them.
	DeadLetters []saga.DeadLetter `json:"dead_letters"`
	// Parent is the saga whose child step (ParentStep) started this one;
	// null for a saga started by a client, a schedule or an event.
	Parent     *uuid.UUID `json:"parent"`
	ParentStep *string    `json:"parent_step"`
	// Children lists the sagas its child steps started.
	Children []saga.ChildRecord `json:"children"`
	// Plan is the definition's forward steps in order, each with the
	// status the saga recorded (pending before it is reached), the
	// branches of a parallel group side by side in one stage. Empty
	// when the definition's version is not recorded.
	Plan []planview.Stage `json:"plan"`
}

// RepairRecord is one operator's repair of a Saga, as recorded.
type RepairRecord struct {
	// Operation is retry, cancel, skip, close, pause or resume.
	Operation string `json:"operation"`
	// Key is the repair request's key.
	Key    string  `json:"key"`
	Reason *string `json:"reason"`
	// By names who asked ("http" for this API, "cli:<user>" for the CLI).
	By *string `json:"by"`
	// Step and Phase name the step a skip marked succeeded; null for the
	// other repairs.
	Step  *string     `json:"step"`
	Phase *saga.Phase `json:"phase"`
	// StateAfter is the saga's state right after the repair.
	StateAfter saga.State `json:"state_after"`
	// At is when the repair committed, on the database's clock.
	At time.Time `json:"at"`
}

// Step is one step execution of a Saga.
type Step struct {
	Step  string     `json:"step"`
	Phase saga.Phase `json:"phase"`
	// Index is the step's position in the definition, from 0.
	Index int `json:"index"`
	// Kind is database, external, callback or child.
	Kind string `json:"kind"`
	// Group is the step's parallel group: the steps of a group run side
	// by side. Null for a step of the line.
	Group *string `json:"group"`
	// Key is the step key, the same on every attempt.
	Key     uuid.UUID       `json:"key"`
	Status  saga.StepStatus `json:"status"`
	Attempt int             `json:"attempt"`
	// PossiblyDone: an attempt's outcome at another system is unknown, so
	// the step may have taken effect whatever its status says.
	PossiblyDone bool `json:"possibly_done"`
	// CallbackToken is a callback step's token, for POST
	// /v1/callbacks/{token}; null for other steps.
	CallbackToken *string         `json:"callback_token"`
	LeaseUntil    *time.Time      `json:"lease_until"`
	NextAttemptAt *time.Time      `json:"next_attempt_at"`
	LastError     *string         `json:"last_error"`
	Result        json.RawMessage `json:"result"`
	CreatedAt     time.Time       `json:"created_at"`
	UpdatedAt     time.Time       `json:"updated_at"`
}

// Attempt is one attempt of one step execution.
type Attempt struct {
	Step         string     `json:"step"`
	Phase        saga.Phase `json:"phase"`
	Attempt      int        `json:"attempt"`
	Key          uuid.UUID  `json:"key"`
	DispatchedAt time.Time  `json:"dispatched_at"`
	FinishedAt   *time.Time `json:"finished_at"`
	// Outcome is succeeded, failed, retry, unknown or lease expired; null
	// while the attempt is in flight.
	Outcome *string `json:"outcome"`
	Error   *string `json:"error"`
}

// List is the body of GET /v1/sagas.
type List struct {
	// Sagas is the page, newest first.
	Sagas []Summary `json:"sagas"`
	// NextCursor continues the listing (the cursor parameter); null when
	// the page is the last.
	NextCursor *string `json:"next_cursor"`
	// Counts is the number of sagas in each state, of the definition
	// filtered on or of all.
	Counts map[saga.State]int64 `json:"counts"`
}

func optional(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func summaryOf(sg *saga.Instance) Summary {
	return Summary{ID: sg.ID, Definition: sg.Definition, Key: sg.Key, State: sg.State, Version: sg.Version,
		Error: optional(sg.Error), CreatedAt: sg.CreatedAt, UpdatedAt: sg.UpdatedAt, FinishedAt: sg.FinishedAt}
}

func sagaOf(sg *saga.Instance) Saga {
	out := Saga{ID: sg.ID, Definition: sg.Definition, Key: sg.Key, State: sg.State, Version: sg.Version,
		Input: sg.Input, Results: sg.Results, Error: optional(sg.Error),
		CreatedAt: sg.CreatedAt, UpdatedAt: sg.UpdatedAt, FinishedAt: sg.FinishedAt, Paused: sg.Paused, DeadlineAt: sg.DeadlineAt,
		Steps: make([]Step, 0, len(sg.Steps)), Attempts: make([]Attempt, 0, len(sg.Attempts)), Repairs: make([]RepairRecord, 0, len(sg.Repairs)),
		Callbacks: append([]saga.CallbackRecord{}, sg.Callbacks...), DefinitionVersion: max(sg.DefinitionVersion, 1),
		DeadLetters: append([]saga.DeadLetter{}, sg.DeadLetters...),
		Parent:      sg.Parent, ParentStep: optional(sg.ParentStep), Children: append([]saga.ChildRecord{}, sg.Children...),
		Plan: []planview.Stage{}}
	if out.Results == nil {
		out.Results = map[string]json.RawMessage{}
	}
	for _, s := range sg.Steps {
		out.Steps = append(out.Steps, Step{Step: s.Step, Phase: s.Phase, Index: s.Index, Kind: s.Kind, Group: optional(s.Group), Key: s.Key,
			Status: s.Status, Attempt: s.Attempt, PossiblyDone: s.PossiblyDone, LeaseUntil: s.LeaseUntil,
			NextAttemptAt: s.NextAttemptAt, LastError: optional(s.LastError), Result: s.Result, CallbackToken: optional(s.CallbackToken),
			CreatedAt: s.CreatedAt, UpdatedAt: s.UpdatedAt})
	}
	for _, at := range sg.Attempts {
		out.Attempts = append(out.Attempts, Attempt{Step: at.Step, Phase: at.Phase, Attempt: at.Attempt, Key: at.Key,
			DispatchedAt: at.DispatchedAt, FinishedAt: at.FinishedAt, Outcome: optional(at.Outcome), Error: optional(at.Error)})
	}
	for _, rp := range sg.Repairs {
		rec := RepairRecord{Operation: rp.Operation, Key: rp.Key, Reason: optional(rp.Reason), By: optional(rp.By),
			Step: optional(rp.Step), StateAfter: rp.StateAfter, At: rp.At.UTC()}
		if rp.Phase != "" {
			ph := rp.Phase
			rec.Phase = &ph
		}
		out.Repairs = append(out.Repairs, rec)
	}
	return out
}

// sagaID reads the {id} of the path, answering 400 when it is not a UUID.
func sagaID(w http.ResponseWriter, r *http.Request) (uuid.UUID, bool) {
	raw := r.PathValue("id")
	id, err := uuid.Parse(raw)
	if err != nil {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid saga ID",
			fmt.Sprintf("%q is not a saga ID; use the \"id\" a start answered with, a UUID, or find a saga by its key with GET /v1/sagas?key=%s", raw, url.QueryEscape(raw))))
		return uuid.Nil, false
	}
	return id, true
}

func sagaNotFound(id uuid.UUID) *Problem {
	return newProblem(http.StatusNotFound, ProblemNotFound, "Saga not found",
		"no saga has ID "+id.String()+"; check the ID a start answered with (finished sagas are deleted after their retention)")
}

// get handles GET /v1/sagas/{id}.
func (a *api) get(w http.ResponseWriter, r *http.Request) {
	id, ok := sagaID(w, r)
	if !ok {
		return
	}
	ctx, cancel := a.readContext(r)
	defer cancel()
	sg, err := a.cfg.Client.Get(ctx, id)
	if errors.Is(err, saga.ErrNotFound) {
		writeProblem(w, sagaNotFound(id))
		return
	}
	if err != nil {
		a.internal(w, r, "read the saga", "retry later", err, "id", id)
		return
	}
	if !covers(w, r, sg.Definition) {
		return
	}
	out := sagaOf(sg)
	if !seesPayloads(r) {
		out.redact()
	}
	if def, err := a.cfg.Client.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion); err == nil {
		out.Plan = planview.Of(def.Describe(), sg.Steps, sg.Skipped)
	} else {
		a.cfg.Logger.WarnContext(r.Context(), "http api: the saga's definition is not known here; its plan is left out", "id", id, "error", err)
	}
	a.encode(w, r, http.StatusOK, out)
}

// listParams are the parameters of GET /v1/sagas.
const listParams = "definition, state, key, created_from, created_before, stuck, dead_lettered, paused, waiting, order, limit and cursor"

// list handles GET /v1/sagas?definition=&state=&key=&created_from=&created_before=&stuck=&dead_lettered=&paused=&waiting=&order=&limit=&cursor=.
func (a *api) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	malformed := func(detail string) {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid query", detail))
	}
	for name, vs := range q {
		switch name {
		case "definition", "state", "key", "created_from", "created_before", "stuck", "dead_lettered", "paused", "waiting", "order", "limit", "cursor":
			if len(vs) > 1 {
				malformed(fmt.Sprintf("parameter %q is given %d times; give it once", name, len(vs)))
				return
			}
		default:
			malformed(fmt.Sprintf("parameter %q is unknown; the parameters are %s", name, listParams))
			return
		}
	}
	opts := engine.ListOptions{Definition: q.Get("definition"), State: saga.State(q.Get("state")), Key: q.Get("key"), Limit: ListLimitDefault, Cursor: q.Get("cursor")}
	if !coversFilter(w, r, opts.Definition) {
		return
	}
	if s := q.Get("limit"); s != "" || q.Has("limit") {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > ListLimitMax {
			malformed(fmt.Sprintf("limit %q must be an integer from 1 to %d", s, ListLimitMax))
			return
		}
		opts.Limit = n
	}
	for name, at := range map[string]*time.Time{"created_from": &opts.CreatedFrom, "created_before": &opts.CreatedBefore} {
		if !q.Has(name) {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, q.Get(name))
		if err != nil {
			malformed(fmt.Sprintf("%s %q must be a time in RFC 3339, such as 2026-12-03T02:00:00Z", name, q.Get(name)))
			return
		}
		*at = t
	}
	for name, on := range map[string]*bool{"stuck": &opts.Stuck, "dead_lettered": &opts.DeadLettered, "paused": &opts.Paused, "waiting": &opts.Waiting} {
		if !q.Has(name) {
			continue
		}
		switch q.Get(name) {
		case "true":
			*on = true
		case "false":
		default:
			malformed(fmt.Sprintf("%s %q must be true or false", name, q.Get(name)))
			return
		}
	}
	switch q.Get("order") {
	case "", "newest":
	case "oldest":
		opts.OldestFirst = true
	default:
		malformed(fmt.Sprintf("order %q must be newest (the default) or oldest", q.Get("order")))
		return
	}
	ctx, cancel := a.readContext(r)
	defer cancel()
	page, err := a.cfg.Client.List(ctx, opts)
	if errors.Is(err, engine.ErrInvalidCursor) {
		malformed(fmt.Sprintf("cursor %q is not a next_cursor this API answered with; start again without one", opts.Cursor))
		return
	}
	if errors.Is(err, engine.ErrInvalidFilter) {
		malformed(trimPrefix(err.Error()))
		return
	}
	if err != nil {
		a.internal(w, r, "list the sagas", "retry later", err)
		return
	}
	counts, err := a.cfg.Client.Counts(ctx, opts.Definition)
	if err != nil {
		a.internal(w, r, "count the sagas", "retry later", err)
		return
	}
	out := List{Sagas: make([]Summary, 0, len(page)), Counts: counts}
	for _, sg := range page {
		out.Sagas = append(out.Sagas, summaryOf(sg))
	}
	if len(page) == opts.Limit {
		c := engine.Cursor(page[len(page)-1])
		out.NextCursor = &c
	}
	a.encode(w, r, http.StatusOK, out)
}

// redact leaves out the saga's data: what its callers gave it and what
// the other systems answered.
func (s *Saga) redact() {
	s.PayloadsRedacted = true
	s.Input, s.Results = nil, nil
	for i := range s.Steps {
		s.Steps[i].Result, s.Steps[i].CallbackToken = nil, nil
	}
	for i := range s.Callbacks {
		s.Callbacks[i].Result = nil
	}
}
