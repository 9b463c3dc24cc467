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
	// Operation is "cancel", "retry", "pause" or "resume".
	Operation string `json:"operation"`
	// State is the saga's state right after the repair committed.
	State saga.State `json:"state"`
	// Key is the Idempotency-Key of the repair.
	Key string `json:"key"`
	// At is when the repair committed, on the database's clock.
	At time.Time `json:"at"`
}

// repairFunc is engine.Client.Cancel or engine.Client.Retry.
type repairFunc func(ctx context.Context, id uuid.UUID, r engine.Repair) (engine.RepairResult, error)

// cancel handles POST /v1/sagas/{id}/cancel.
func (a *api) cancel(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "cancel", a.cfg.Client.Cancel)
}

// retry handles POST /v1/sagas/{id}/retry.
func (a *api) retry(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "retry", a.cfg.Client.Retry)
}

// repair checks the request, then leaves it to the engine, which records
// the repair under its key in the repair's own transaction.
func (a *api) repair(w http.ResponseWriter, r *http.Request, op string, do repairFunc) {
	id, ok := sagaID(w, r)
	if !ok {
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
	var reason string
	if len(bytes.TrimSpace(body)) > 0 {
		if p := requireJSON(w, r.Header); p != nil {
			writeProblem(w, p)
			return
		}
		if reason, p = decodeReason(body); p != nil {
			writeProblem(w, p)
			return
		}
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	res, err := do(ctx, id, engine.Repair{Key: key, Reason: reason, By: "http"})
	var inFlight *engine.StepInFlightError
	switch {
	case errors.Is(err, saga.ErrNotFound):
		writeProblem(w, sagaNotFound(id))
		return
	case errors.As(err, &inFlight):
		wait := max(1, int(math.Ceil(time.Until(inFlight.Until).Seconds())))
		w.Header().Set("Retry-After", strconv.Itoa(wait))
		writeProblem(w, newProblem(http.StatusConflict, ProblemInFlight, "A step is calling another system", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrStateForbids):
		writeProblem(w, newProblem(http.StatusConflict, ProblemStateForbids, "The saga's state does not allow this", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrRepairKeyReused):
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q already names another request on saga %s (another operation or reason); resend that request to get its answer, or use a new key", key, id)))
		return
	case errors.Is(err, saga.ErrInvalidKey):
		writeProblem(w, invalidKey(trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrDeploymentMismatch):
		writeProblem(w, newProblem(http.StatusServiceUnavailable, ProblemMisconfigured, "Server misconfigured",
			"this server's settings or definitions differ from the deployment's; nothing was written. Retry later, or with another server"))
		return
	case err != nil:
		a.internal(w, r, op+" the saga", "retrying with the same Idempotency-Key is safe: it answers with the repair if it was done", err,
			"id", id, "key", key)
		return
	}
	if res.Replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	a.encode(w, r, http.StatusOK, Repaired{ID: res.ID, Operation: res.Operation, State: res.State, Key: res.Key, At: res.At.UTC()})
}

// decodeReason reads a repair body: one JSON object with at most the
// string member "reason", named exactly and once.
func decodeReason(body []byte) (string, *Problem) {
	bad := func(detail string) (string, *Problem) {
		return "", newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid request body",
			detail+`; send {"reason":"<why>"} or no body`)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return bad("the body is not a JSON object")
	}
	var reason string
	seen := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return bad("the body is not valid JSON")
		}
		if name, _ := tok.(string); name != "reason" {
			return bad(fmt.Sprintf("member %q is unknown (names are matched exactly)", tok))
		}
		if seen {
			return bad(`member "reason" appears twice`)
		}
		seen = true
		tok, err = dec.Token()
		if err != nil {
			return bad("the body is not valid JSON")
		}
		s, ok := tok.(string)
		if !ok {
			return bad(`member "reason" must be a string`)
		}
		reason = s
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return bad("the body is not valid JSON")
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return bad("the body holds more than one JSON value")
	}
	return reason, nil
}
