package httpapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// pause handles POST /v1/sagas/{id}/pause: the saga starts no attempt
// until it is resumed.
func (a *api) pause(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "pause", a.cfg.Client.Pause)
}

// resume handles POST /v1/sagas/{id}/resume.
func (a *api) resume(w http.ResponseWriter, r *http.Request) {
	a.repair(w, r, "resume", a.cfg.Client.Resume)
}

// pauseDefinition handles POST /v1/definitions/{definition}/pause: every
// saga of the definition, running or started while it is paused, is held.
func (a *api) pauseDefinition(w http.ResponseWriter, r *http.Request) {
	a.definitionRepair(w, r, "pause", a.cfg.Client.PauseDefinition)
}

// resumeDefinition handles POST /v1/definitions/{definition}/resume.
func (a *api) resumeDefinition(w http.ResponseWriter, r *http.Request) {
	a.definitionRepair(w, r, "resume", a.cfg.Client.ResumeDefinition)
}

// definitionRepair is repair for a whole definition; its answer is an
// engine.DefinitionRepair.
func (a *api) definitionRepair(w http.ResponseWriter, r *http.Request, op string,
	do func(ctx context.Context, definition string, rp engine.Repair) (engine.DefinitionRepair, error)) {
	name := r.PathValue("definition")
	if !covers(w, r, name) {
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
		req, p := decodeRepairBody(body, `send {"reason":"<why>"} or no body`, "reason")
		if p != nil {
			writeProblem(w, p)
			return
		}
		reason = req.Reason
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	res, err := do(ctx, name, engine.Repair{Key: key, Reason: reason, By: author(r)})
	switch {
	case errors.Is(err, saga.ErrUnknownDefinition):
		writeProblem(w, newProblem(http.StatusNotFound, ProblemUnknownDefinition, "Unknown saga definition",
			fmt.Sprintf("no saga definition is named %q; the deployment records a definition when a worker running it starts", name)))
		return
	case errors.Is(err, engine.ErrStateForbids):
		writeProblem(w, newProblem(http.StatusConflict, ProblemStateForbids, "The definition's state does not allow this", trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrRepairKeyReused):
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q already names another request on definition %q (another operation or reason); resend that request to get its answer, or use a new key", key, name)))
		return
	case errors.Is(err, saga.ErrInvalidKey):
		writeProblem(w, invalidKey(trimPrefix(err.Error())))
		return
	case errors.Is(err, engine.ErrDeploymentMismatch):
		writeProblem(w, newProblem(http.StatusServiceUnavailable, ProblemMisconfigured, "Server misconfigured",
			"this server's settings or definitions differ from the deployment's; nothing was written. Retry later, or with another server"))
		return
	case err != nil:
		a.internal(w, r, op+" the definition", "retrying with the same Idempotency-Key is safe: it answers with the repair if it was done", err,
			"definition", name, "key", key)
		return
	}
	if res.Replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	res.At = res.At.UTC()
	a.encode(w, r, http.StatusOK, res)
}
