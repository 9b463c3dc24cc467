package httpapi

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// CallbackRequest is the body of POST /v1/callbacks/{token}: another
// system's answer to a callback step's request.
type CallbackRequest struct {
	// EventID is the other system's id for the event, the same in every
	// delivery of it. Required.
	EventID string `json:"event_id"`
	// Result is the step's result (any JSON).
	Result jsontext.Value `json:"result,omitzero"`
	// Error, if set, says the other system refused the request.
	Error string `json:"error,omitzero"`
}

// Completed is the answer to a callback: 200 once the event completed the
// step or was recorded as late or superseded, 202 while it is pending; a
// delivery of an event already received answers with its record and
// Idempotent-Replayed: true.
type Completed struct {
	SagaID     uuid.UUID  `json:"saga_id"`
	Step       string     `json:"step"`
	EventID    string     `json:"event_id"`
	Outcome    string     `json:"outcome"`
	Detail     string     `json:"detail"`
	State      saga.State `json:"state"`
	ReceivedAt time.Time  `json:"received_at"`
}

// Problem types of callbacks.
const (
	// ProblemCallbackReused: the event id was already received with
	// another body, or for another step (422).
	ProblemCallbackReused = "urn:idemsaga:problem:callback-event-reused"
	// ProblemNotCallbackStep: the token names a step that takes no
	// callbacks (422).
	ProblemNotCallbackStep = "urn:idemsaga:problem:not-a-callback-step"
	// ProblemCallbackSignature: the definition signs its callbacks and
	// this one's signature is missing or wrong (401).
	ProblemCallbackSignature = "urn:idemsaga:problem:callback-signature"
)

// callback handles POST /v1/callbacks/{token}.
func (a *api) callback(w http.ResponseWriter, r *http.Request) {
	token := r.PathValue("token")
	id, _, err := saga.ParseCallbackToken(token)
	if err != nil {
		writeProblem(w, newProblem(http.StatusNotFound, ProblemNotFound, "No such callback token",
			trimPrefix(err.Error())+"; use the token the step gave with its request"))
		return
	}
	if !a.coversSaga(w, r, id) {
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
	var req CallbackRequest
	if err := jsonv2.Unmarshal(body, &req, jsonv2.RejectUnknownMembers(true)); err != nil {
		why := "it is not a JSON object with those members"
		var serr *jsonv2.SemanticError
		var synerr *jsontext.SyntacticError
		switch {
		case errors.As(err, &synerr) && strings.Contains(synerr.Error(), "duplicate"):
			why = fmt.Sprintf("member %q appears twice", strings.TrimPrefix(string(synerr.JSONPointer), "/"))
		case errors.As(err, &synerr):
			why = "it is not valid JSON"
		case errors.As(err, &serr) && errors.Is(err, jsonv2.ErrUnknownName):
			why = fmt.Sprintf("member %q is unknown (names are matched exactly)", strings.TrimPrefix(string(serr.JSONPointer), "/"))
		case errors.As(err, &serr) && serr.JSONPointer != "":
			why = fmt.Sprintf("member %q has the wrong type", strings.TrimPrefix(string(serr.JSONPointer), "/"))
		}
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid callback body",
			why+`; send {"event_id":"<the event's id>","result":<JSON>} or {"event_id":"…","error":"<why it was refused>"}`))
		return
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	res, err := a.cfg.Client.Complete(ctx, engine.Callback{Token: token, EventID: req.EventID, Result: []byte(req.Result), Error: req.Error,
		Body: body, Signature: r.Header.Get(saga.CallbackSignatureHeader)})
	switch {
	case errors.Is(err, saga.ErrCallbackSignature):
		a.cfg.Logger.Warn("callback refused: its signature is missing or wrong", "token", token, "error", err)
		writeProblem(w, newProblem(http.StatusUnauthorized, ProblemCallbackSignature, "Callback signature not valid",
			trimPrefix(err.Error())+"; nothing was written"))
		return
	case errors.Is(err, saga.ErrNotFound):
		writeProblem(w, newProblem(http.StatusNotFound, ProblemNotFound, "No such step", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrNotCallbackStep):
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemNotCallbackStep, "The step is not a callback step", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrCallbackReused):
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemCallbackReused, "Callback event id reused",
			trimPrefix(err.Error())+"; nothing was written. Send the event's first body again, or give another event its own id"))
		return
	case errors.Is(err, engine.ErrResultTooLarge):
		writeProblem(w, newProblem(http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Result too large", trimPrefix(err.Error())+"; nothing was written"))
		return
	case errors.Is(err, engine.ErrInvalidCallback):
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid callback", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrDeploymentMismatch):
		writeProblem(w, newProblem(http.StatusServiceUnavailable, ProblemMisconfigured, "Server misconfigured",
			"this server's settings or definitions differ from the deployment's; nothing was written. Retry later, or with another server"))
		return
	case err != nil:
		a.internal(w, r, "record the callback", "delivering it again with the same event id is safe", err, "token", token)
		return
	}
	status := http.StatusOK
	if res.Outcome == engine.CallbackPending {
		status = http.StatusAccepted
	}
	if res.Replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	a.encode(w, r, status, Completed{SagaID: res.SagaID, Step: res.Step, EventID: res.EventID, Outcome: res.Outcome,
		Detail: res.Detail, State: res.State, ReceivedAt: res.ReceivedAt.UTC()})
}
