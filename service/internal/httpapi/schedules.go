package httpapi

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// ProblemScheduleNotFound: no schedule is recorded for the definition.
const ProblemScheduleNotFound = "urn:idemsaga:problem:schedule-not-found"

// Schedules is the answer of GET /v1/schedules.
type Schedules struct {
	Schedules []engine.ScheduleInfo `json:"schedules"`
}

// EventDeadLetters is the answer of GET /v1/event-dead-letters.
type EventDeadLetters struct {
	EventDeadLetters []engine.EventDeadLetter `json:"event_dead_letters"`
}

// schedules handles GET /v1/schedules: every recorded schedule, by
// definition.
func (a *api) schedules(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := a.readContext(r)
	defer cancel()
	list, err := a.cfg.Client.Schedules(ctx)
	if err != nil {
		a.internal(w, r, "list the schedules", "retry later", err)
		return
	}
	if list == nil {
		list = []engine.ScheduleInfo{}
	}
	a.encode(w, r, http.StatusOK, Schedules{Schedules: list})
}

// pauseSchedule handles POST /v1/schedules/{definition}/pause: the
// schedule starts no saga until resumed, and its ticks meanwhile are
// skipped.
func (a *api) pauseSchedule(w http.ResponseWriter, r *http.Request) {
	a.scheduleRepair(w, r, "pause")
}

// resumeSchedule handles POST /v1/schedules/{definition}/resume.
func (a *api) resumeSchedule(w http.ResponseWriter, r *http.Request) {
	a.scheduleRepair(w, r, "resume")
}

// scheduleRepair pauses or resumes a schedule, as op says; its answer is
// an engine.ScheduleRepair.
func (a *api) scheduleRepair(w http.ResponseWriter, r *http.Request, op string) {
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
	rp := engine.Repair{Key: key, Reason: reason, By: author(r)}
	do := a.cfg.Client.PauseSchedule
	if op == "resume" {
		do = a.cfg.Client.ResumeSchedule
	}
	res, err := do(ctx, name, rp)
	switch {
	case errors.Is(err, engine.ErrScheduleNotFound):
		writeProblem(w, newProblem(http.StatusNotFound, ProblemScheduleNotFound, "No such schedule",
			fmt.Sprintf("no schedule is recorded for definition %q; a schedule is recorded when a worker that runs it starts (GET /v1/schedules lists them)", name)))
	case errors.Is(err, engine.ErrStateForbids):
		writeProblem(w, newProblem(http.StatusConflict, ProblemStateForbids, "The schedule's state does not allow this", trimPrefix(err.Error())))
	case errors.Is(err, engine.ErrRepairKeyReused):
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q already names another request on the schedule of %q (another operation or reason); resend that request to get its answer, or use a new key", key, name)))
	case errors.Is(err, saga.ErrInvalidKey):
		writeProblem(w, invalidKey(trimPrefix(err.Error())))
	case err != nil:
		a.internal(w, r, op+" the schedule", "retrying with the same Idempotency-Key is safe: it answers with the first result if it was done", err,
			"definition", name, "key", key)
	default:
		if res.Replayed {
			w.Header().Set(ReplayedHeader, "true")
		}
		res.At = res.At.UTC()
		a.encode(w, r, http.StatusOK, res)
	}
}

// eventDeadLetters handles GET /v1/event-dead-letters: the events that
// could not start a saga, oldest first; ?definition= and ?limit= (1 to
// 1000, 100 by default) filter them.
func (a *api) eventDeadLetters(w http.ResponseWriter, r *http.Request) {
	f := engine.EventDeadLetterFilter{Definition: r.URL.Query().Get("definition"), Limit: 100}
	if l := r.URL.Query().Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 1000 {
			writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Malformed request",
				fmt.Sprintf("limit %q must be a whole number from 1 to 1000", l)))
			return
		}
		f.Limit = n
	}
	if !coversFilter(w, r, f.Definition) {
		return
	}
	ctx, cancel := a.readContext(r)
	defer cancel()
	dls, err := a.cfg.Client.EventDeadLetters(ctx, f)
	if err != nil {
		a.internal(w, r, "list the event dead letters", "retry later", err)
		return
	}
	if dls == nil {
		dls = []engine.EventDeadLetter{}
	}
	if !seesPayloads(r) {
		for i := range dls {
			dls[i].Body, dls[i].Headers = nil, nil
		}
	}
	a.encode(w, r, http.StatusOK, EventDeadLetters{EventDeadLetters: dls})
}
