package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// Repaired is the body of a successful cancel, retry, pause or resume of
// a saga: the repair as it
// committed, the same bytes when a request with its key is sent again.
type Repaired struct {
	// ID is the saga's.
	ID uuid.UUID `json:"id"`
	// Operation is "cancel", "retry", "skip", "close", "pause" or "resume".
	Operation string `json:"operation"`
	// State is the saga's state right after the repair committed.
	State saga.State `json:"state"`
	// Key is the Idempotency-Key of the repair.
	Key string `json:"key"`
	// At is when the repair committed, on the database's clock.
	At time.Time `json:"at"`
}

// repairFunc is engine.Client.Cancel, Retry or Close, or a Skip with its
// step.
type repairFunc func(ctx context.Context, id uuid.UUID, r engine.Repair) (engine.RepairResult, error)

// cancel handles POST /v1/sagas/{id}/cancel.
func (a *api) cancel(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "cancel", a.cfg.Client.Cancel)
}

// retry handles POST /v1/sagas/{id}/retry.
func (a *api) retry(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "retry", a.cfg.Client.Retry)
}

// close handles POST /v1/sagas/{id}/close.
func (a *api) close(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "close", a.cfg.Client.Close)
}

// skip handles POST /v1/sagas/{id}/skip, body {"step":…,"result":…,"reason":…}.
func (a *api) skip(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "skip", nil)
}

// repair checks the request, then leaves it to the engine, which records
// the repair under its key in the repair's own transaction. do nil is a
// skip, whose body names its step.
func (a *api) repair(w http.ResponseWriter, r *http.Request, op string, do repairFunc) {
	id, ok := sagaID(w, r)
	if !ok || !a.coversSaga(w, r, id) {
		return
	}
	key, p := requestKey(r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	body, p := a.readBody(w, r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	var req repairBody
	if len(bytes.TrimSpace(body)) > 0 || do == nil {
		if p := requireJSON(w, r.Header); p != nil {
			writeProblem(w, p)
			return
		}
		members := []string{"reason"}
		hint := `send {"reason":"<why>"} or no body`
		if do == nil {
			members, hint = []string{"step", "result", "reason"}, `send {"step":"<name>","result":<JSON>,"reason":"<why>"}`
		}
		if req, p = decodeRepairBody(body, hint, members...); p != nil {
			writeProblem(w, p)
			return
		}
	}
	if do == nil {
		if req.Step == "" {
			writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid request body",
				`member "step" is missing: name the step to skip (GET /v1/sagas/{id} lists them); send {"step":"<name>","result":<JSON>,"reason":"<why>"}`))
			return
		}
		do = func(ctx context.Context, id uuid.UUID, rp engine.Repair) (engine.RepairResult, error) {
			return a.cfg.Client.Skip(ctx, id, engine.SkipStep{Step: req.Step, Result: req.Result}, rp)
		}
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	res, err := do(ctx, id, engine.Repair{Key: key, Reason: req.Reason, By: author(r)})
	if err != nil {
		p, wait := repairProblem(err, id, key)
		if p == nil {
			a.internal(w, r, op+" the saga", "retrying with the same Idempotency-Key is safe: it answers with the repair if it was done", err,
				"id", id, "key", key)
			return
		}
		if wait > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(wait))
		}
		writeProblem(w, p)
		return
	}
	if res.Replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	a.encode(w, r, http.StatusOK, Repaired{ID: res.ID, Operation: res.Operation, State: res.State, Key: res.Key, At: res.At.UTC()})
}

// repairProblem is the answer to a repair's error, with the seconds of its
// Retry-After (0: none); nil for an error of the server's.
func repairProblem(err error, id uuid.UUID, key string) (*Problem, int) {
	var inFlight *engine.StepInFlightError
	switch {
	case errors.Is(err, saga.ErrNotFound):
		return sagaNotFound(id), 0
	case errors.As(err, &inFlight):
		wait := max(1, int(math.Ceil(time.Until(inFlight.Until).Seconds())))
		return newProblem(http.StatusConflict, ProblemInFlight, "A step is calling another system", trimPrefix(err.Error())), wait
	case errors.Is(err, engine.ErrStateForbids):
		return newProblem(http.StatusConflict, ProblemStateForbids, "The saga's state does not allow this", trimPrefix(err.Error())), 0
	case errors.Is(err, engine.ErrRepairKeyReused):
		return newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q already names another request on saga %s (another operation, reason or result); resend that request to get its answer, or use a new key", key, id)), 0
	case errors.Is(err, engine.ErrInvalidResult):
		return newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid step result", trimPrefix(err.Error())), 0
	case errors.Is(err, engine.ErrResultTooLarge):
		return newProblem(http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Result too large", trimPrefix(err.Error())+"; nothing was written"), 0
	case errors.Is(err, saga.ErrInvalidKey):
		return invalidKey(trimPrefix(err.Error())), 0
	case errors.Is(err, engine.ErrDeploymentMismatch):
		return newProblem(http.StatusServiceUnavailable, ProblemMisconfigured, "Server misconfigured",
			"this server's settings or definitions differ from the deployment's; nothing was written. Retry later, or with another server"), 0
	}
	return nil, 0
}

// repairBody is what a repair's body may carry.
type repairBody struct {
	Reason string
	Step   string
	Result json.RawMessage
	// The members of a bulk repair (POST /v1/repairs).
	Operation string
	Filter    json.RawMessage
	Limit     *int
	Cursor    string
	DryRun    bool
	// The members of a bulk repair's filter.
	Definition string
	State      string
}

// decodeRepairBody reads a repair body: one JSON object whose members are
// among members, each named exactly and once; hint says what to send.
func decodeRepairBody(body []byte, hint string, members ...string) (repairBody, *Problem) {
	var out repairBody
	bad := func(detail string) (repairBody, *Problem) {
		return repairBody{}, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid request body", detail+"; "+hint)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return bad("the body is not a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return bad("the body is not valid JSON")
		}
		name, _ := tok.(string)
		if !slices.Contains(members, name) {
			return bad(fmt.Sprintf("member %q is unknown (names are matched exactly)", tok))
		}
		if seen[name] {
			return bad(fmt.Sprintf("member %q appears twice", name))
		}
		seen[name] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return bad("the body is not valid JSON")
		}
		var derr error
		switch name {
		case "reason":
			derr = json.Unmarshal(raw, &out.Reason)
		case "step":
			derr = json.Unmarshal(raw, &out.Step)
		case "operation":
			derr = json.Unmarshal(raw, &out.Operation)
		case "cursor":
			derr = json.Unmarshal(raw, &out.Cursor)
		case "definition":
			derr = json.Unmarshal(raw, &out.Definition)
		case "state":
			derr = json.Unmarshal(raw, &out.State)
		case "result":
			out.Result = raw
		case "filter":
			out.Filter = raw
		case "limit":
			out.Limit = new(int)
			derr = json.Unmarshal(raw, out.Limit)
		case "dry_run":
			derr = json.Unmarshal(raw, &out.DryRun)
		}
		if derr != nil || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) && name != "result" {
			kind := map[string]string{"limit": "an integer", "dry_run": "true or false", "result": "JSON"}[name]
			if kind == "" {
				kind = "a string"
			}
			return bad(fmt.Sprintf("member %q must be %s", name, kind))
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return bad("the body is not valid JSON")
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return bad("the body holds more than one JSON value")
	}
	return out, nil
}
