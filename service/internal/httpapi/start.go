package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/startlock"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
)

// Started is the body of a successful POST /v1/sagas/{definition}: the
// answer as of the saga's creation, the same bytes for every request that
// names the saga. Read its progress with GET /v1/sagas/{id}.
type Started struct {
	// ID identifies the saga.
	ID uuid.UUID `json:"id"`
	// Definition is the saga's definition.
	Definition string `json:"definition"`
	// Key is the Idempotency-Key, which is the saga's key.
	Key string `json:"key"`
	// State is the state at creation: always "init".
	State saga.State `json:"state"`
}

// start handles POST /v1/sagas/{definition}. Every check that can refuse
// the request runs before the start; in its transaction, the key's
// advisory lock tells a concurrent request apart, and the engine's unique
// (definition, key) adjudicates the start.
func (a *api) start(w http.ResponseWriter, r *http.Request) {
	key, p := requestKey(r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	if p := requireJSON(w, r.Header); p != nil {
		writeProblem(w, p)
		return
	}
	body, p := a.readBody(w, r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	if a.cfg.TraceRequests {
		ctx = tracing.FromHTTP(ctx, r.Header)
	}
	name := r.PathValue("definition")
	if !covers(w, r, name) {
		return
	}
	def, err := a.cfg.Client.Definition(ctx, name)
	if errors.Is(err, saga.ErrUnknownDefinition) {
		writeProblem(w, newProblem(http.StatusNotFound, ProblemUnknownDefinition, "Unknown saga definition",
			fmt.Sprintf("no saga definition is named %q; GET /v1/sagas lists the sagas there are, and the deployment records a definition when a worker running it starts", name)))
		return
	}
	if err != nil {
		a.internal(w, r, "resolve the saga definition", "retrying with the same Idempotency-Key is safe", err, "definition", name)
		return
	}
	input, err := def.Input(json.RawMessage(body))
	if errors.Is(err, saga.ErrInvalidInput) {
		writeProblem(w, invalidInput(err))
		return
	}
	if err != nil {
		a.internal(w, r, "check the saga input", "retrying with the same Idempotency-Key is safe", err, "definition", name)
		return
	}
	// After the input's check: a request that can never start is told
	// so, not told to come back later.
	if a.shed(ctx, w, def.Name(), key) {
		return
	}
	// Settings and definitions are checked once per client, on the pool:
	// done here, before the transaction holds a connection of it.
	if err := a.cfg.Client.Check(ctx); err != nil {
		a.startFailed(w, r, def.Name(), key, uuid.Nil, err)
		return
	}
	res, held, err := a.startLocked(ctx, def, key, input)
	switch {
	case err != nil:
		a.startFailed(w, r, def.Name(), key, res.ID, err)
		return
	case held:
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(http.StatusConflict, ProblemInFlight, "Request in flight",
			fmt.Sprintf("another request with Idempotency-Key %q for %s is being handled right now; retry this request in a second to get its answer", key, def.Name())))
		return
	}
	out, err := json.Marshal(Started{ID: res.ID, Definition: def.Name(), Key: key, State: saga.StateInit})
	if err != nil {
		a.internal(w, r, "encode the answer", "retrying with the same Idempotency-Key is safe", err)
		return
	}
	w.Header().Set("Location", "/v1/sagas/"+res.ID.String())
	status := http.StatusCreated
	if res.Duplicate {
		status = http.StatusOK
		w.Header().Set(ReplayedHeader, "true")
	}
	writeJSON(w, status, out)
}

// startLocked starts the saga with the key's advisory lock tried first,
// without waiting, in the transaction that inserts it (and, when this
// process runs the saga's first step, runs that step's first attempt).
// held reports that another transaction has it: nothing was done.
func (a *api) startLocked(ctx context.Context, def *saga.Definition, key string, input json.RawMessage) (res engine.StartResult, held bool, err error) {
	res, err = a.cfg.Client.Start(startlock.With(ctx), def, key, input)
	if errors.Is(err, startlock.ErrHeld) {
		return res, true, nil
	}
	return res, false, err
}

// startFailed answers a start the engine refused or failed.
func (a *api) startFailed(w http.ResponseWriter, r *http.Request, definition, key string, existing uuid.UUID, err error) {
	switch {
	case errors.Is(err, saga.ErrIdempotencyKeyReused):
		detail := fmt.Sprintf("Idempotency-Key %q already names a saga of %s", key, definition)
		if existing != uuid.Nil {
			detail += " (" + existing.String() + ")"
		}
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			detail+" started with another input; resend that input to get its answer, or use a new key for a new saga"))
	case errors.Is(err, saga.ErrInvalidInput):
		writeProblem(w, invalidInput(err))
	case errors.Is(err, saga.ErrInvalidKey):
		writeProblem(w, invalidKey(trimPrefix(err.Error())))
	case errors.Is(err, engine.ErrSubmitTokenInvalid):
		writeProblem(w, submitTokenInvalid(definition, err))
	case errors.Is(err, engine.ErrDeploymentMismatch):
		a.cfg.Logger.ErrorContext(r.Context(), "http api: refusing to start sagas: this process differs from the deployment",
			"definition", definition, "error", err)
		writeProblem(w, newProblem(http.StatusServiceUnavailable, ProblemMisconfigured, "Server misconfigured",
			"this server's settings or definitions differ from the deployment's, so it starts no saga; nothing was written. Retry later, or with another server"))
	default:
		a.internal(w, r, "start the saga", "retrying with the same Idempotency-Key is safe: it answers with the saga if one was started", err,
			"definition", definition, "key", key)
	}
}

func invalidInput(err error) *Problem {
	detail := err.Error()
	var ie *saga.InputError
	if errors.As(err, &ie) {
		detail = ie.Problem
	}
	return newProblem(http.StatusBadRequest, ProblemInvalidInput, "Invalid saga input", detail+"; nothing was written")
}

// requireJSON accepts Content-Type application/json, in UTF-8 if a
// charset is given.
func requireJSON(w http.ResponseWriter, hdr http.Header) *Problem {
	ct := hdr.Get("Content-Type")
	mt, params, err := mime.ParseMediaType(ct)
	if err == nil && mt == "application/json" {
		if cs, ok := params["charset"]; !ok || strings.EqualFold(cs, "utf-8") {
			return nil
		}
	}
	w.Header().Set("Accept", "application/json")
	detail := "send the body as JSON with Content-Type: application/json"
	if ct != "" {
		detail = fmt.Sprintf("Content-Type %q is not supported; %s (UTF-8)", ct, detail)
	}
	return newProblem(http.StatusUnsupportedMediaType, ProblemUnsupportedMediaType, "Unsupported media type", detail)
}

// readBody reads the body, at most MaxBodyBytes.
func (a *api) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *Problem) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, a.cfg.MaxBodyBytes))
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return nil, newProblem(http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
			fmt.Sprintf("the body exceeds %d bytes; keep large payloads elsewhere and pass a reference", tooLarge.Limit))
	}
	if err != nil {
		return nil, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Unreadable request body",
			"the body could not be read ("+err.Error()+"); send it again")
	}
	return body, nil
}

// shed answers 503 and reports true when Config.ShedFunc refuses a start of
// definition now and key started no saga yet; nothing is written.
func (a *api) shed(ctx context.Context, w http.ResponseWriter, definition, key string) bool {
	if a.cfg.ShedFunc == nil {
		return false
	}
	err := a.cfg.ShedFunc(ctx, definition)
	if err == nil {
		return false
	}
	// A key that started its saga already is answered as always (a
	// replay writes nothing): a 503 would tell its client, wrongly, that
	// nothing was started.
	if _, err := a.cfg.Client.GetByKey(ctx, definition, key); err == nil {
		return false
	}
	after, why := time.Second, "the engine is overloaded"
	var o *engine.Overload
	if errors.As(err, &o) {
		after, why = o.RetryAfter, fmt.Sprintf("%s (%d waiting for a worker now, the oldest for %s)", o.Reason, o.Messages, o.OldestAge.Round(100*time.Millisecond))
	}
	secs := max(int(after.Round(time.Second)/time.Second), 1)
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	writeProblem(w, newProblem(http.StatusServiceUnavailable, ProblemOverloaded, "Overloaded",
		fmt.Sprintf("the saga was not started, and nothing was written (no saga, no Idempotency-Key recorded, a submit token stays unused), because the engine's queue is behind: %s; send the same request again, with the same Idempotency-Key, after %d seconds (Retry-After)", why, secs)))
	return true
}
