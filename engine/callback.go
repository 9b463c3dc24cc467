package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Callback is another system's answer to a CallbackStep's request.
type Callback struct {
	// Token names the step: StepContext.CallbackToken(), which the step's
	// request gave the other system. Required.
	Token string
	// EventID is the other system's own id for this event (a payment
	// channel's transaction number), the same in every delivery of it:
	// the first delivery decides, and every later one is answered from
	// its record. 1 to 255 printable ASCII characters. Required.
	EventID string
	// Result is the step's result, as JSON (empty for none).
	Result json.RawMessage
	// Error, if not empty, says the other system refused the request: the
	// step failed for good, without effect, and the saga compensates the
	// steps before it. Give Result or Error, not both.
	Error string
}

// Callback outcomes, CallbackResult.Outcome.
const (
	// CallbackApplied: the callback completed the step (it succeeded, or
	// failed when Callback.Error was given).
	CallbackApplied = "applied"
	// CallbackPending: the step's request is not recorded yet (the answer
	// raced the request); the callback is applied when the step waits.
	CallbackPending = "pending"
	// CallbackLate: the step no longer waits (given up, cancelled,
	// compensated); the callback is recorded and changes nothing. A
	// person should look at the saga: the other system acted late.
	CallbackLate = "late"
	// CallbackSuperseded: another event completed the step first; this
	// one is recorded and changes nothing.
	CallbackSuperseded = "superseded"
)

// CallbackResult is what a callback did.
type CallbackResult struct {
	SagaID  uuid.UUID
	Step    string
	EventID string
	// Outcome is CallbackApplied, CallbackPending, CallbackLate or
	// CallbackSuperseded: for a delivery of an event already received,
	// what that event did (a pending one may have been applied since).
	Outcome string
	// Detail says in a sentence what happened, for the other system's log.
	Detail string
	// State is the saga's state after the callback.
	State saga.State
	// ReceivedAt is when the event was first received, on the database
	// clock.
	ReceivedAt time.Time
	// Replayed is true when the event was received before: nothing was
	// written.
	Replayed bool
}

// ErrCallbackReused is returned for an event id already received with
// another body, or for another saga's step. Nothing is written.
var ErrCallbackReused = errors.New("idemsaga: this callback event id was already received with another body; an event id names one event")

// ErrNotCallbackStep is returned by Complete for a token that names a
// step that is not a saga.CallbackStep. Nothing is written.
var ErrNotCallbackStep = errors.New("idemsaga: the step is not a callback step")

// ErrInvalidCallback is returned by Complete for a callback that is
// malformed (an event id that breaks the key rules, a result that is not
// JSON, both a result and an error). Nothing is written.
var ErrInvalidCallback = errors.New("idemsaga: invalid callback")

// Complete delivers a callback to the CallbackStep its token names, any
// number of times. The event id's first delivery decides, under a unique
// constraint and the saga's lock: it completes the step if the step
// waits; it is kept and applied when the step waits if the step's request
// is not recorded yet; and it is recorded as late, changing nothing, if
// the step no longer waits. Every later delivery of the event is answered
// from its record (Replayed); one with another body is ErrCallbackReused.
func (cl *Client) Complete(ctx context.Context, cb Callback) (CallbackResult, error) {
	id, step, err := saga.ParseCallbackToken(cb.Token)
	if err != nil {
		return CallbackResult{}, err
	}
	if cb.EventID == "" {
		return CallbackResult{}, fmt.Errorf("%w: it has no event id; give the other system's own id for this event (its transaction or event number), the same in every delivery", ErrInvalidCallback)
	}
	if err := saga.CheckKey(cb.EventID); err != nil {
		return CallbackResult{}, fmt.Errorf("%w: event id %q: 1 to %d printable ASCII characters without surrounding spaces", ErrInvalidCallback, cb.EventID, saga.MaxKeyLength)
	}
	var result json.RawMessage
	switch {
	case cb.Error != "" && len(cb.Result) > 0:
		return CallbackResult{}, fmt.Errorf("%w: give a result or an error, not both", ErrInvalidCallback)
	case len(cb.Result) > 0:
		if result, err = saga.CanonicalInput(cb.Result); err != nil {
			return CallbackResult{}, fmt.Errorf("%w: result: %w", ErrInvalidCallback, err)
		}
	}
	if err := cl.resolveSaga(ctx, id); err != nil {
		return CallbackResult{}, err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%t\x00%s\x00", cb.Error != "", cb.Error)
	h.Write(result)
	hash := h.Sum(nil)

	c := cl.c
	var res CallbackResult
	var def *saga.Definition
	fx := &effects{}
	err = c.withSagaLocked(ctx, id, "complete a step of", func(tx *store.Tx, sg *saga.Instance) error {
		fx = &effects{}
		res = CallbackResult{SagaID: id, Step: step, EventID: cb.EventID}
		var err error
		if def, err = c.definitionAt(ctx, sg.Definition, sg.DefinitionVersion); err != nil {
			return err
		}
		idx := def.StepIndex(step)
		if idx < 0 {
			return fmt.Errorf("%w: definition %s of saga %s has no step %q; use the token the step gave with its request", ErrNotCallbackStep, saga.Ref(sg.Definition, sg.DefinitionVersion), id, step)
		}
		if k := def.Step(idx).Kind; k != saga.CallbackStep {
			return fmt.Errorf("%w: step %q of %q is a %s step; only a saga.CallbackStep takes callbacks", ErrNotCallbackStep, step, sg.Definition, k)
		}
		if replayed, err := c.replayCallback(ctx, tx, sg, step, cb.EventID, hash, &res); replayed || err != nil {
			return err
		}
		return c.receiveCallback(ctx, tx, sg, def, idx, cb, result, hash, &res, fx)
	}, func() { c.emit(fx) })
	if err != nil {
		return CallbackResult{}, err
	}
	outcome := res.Outcome
	if res.Replayed {
		outcome = "duplicate"
		c.metrics.Duplicates.WithLabelValues(metrics.LayerCallback).Inc()
	}
	c.metrics.Deliveries.WithLabelValues(metrics.LayerCallback).Inc()
	c.metrics.Callbacks.WithLabelValues(def.Name(), step, outcome).Inc()
	if res.Outcome == CallbackLate && !res.Replayed {
		c.log.Warn("callback for a step that no longer waits; recorded, nothing changed (if the step was given up or cancelled, look at the saga: the other system acted after the engine stopped waiting)",
			"saga_id", id, "step", step, "event_id", cb.EventID, "state", res.State)
	}
	return res, nil
}

// replayCallback answers an event already received from its record; an
// event id received with another body, or for another saga's step, is
// ErrCallbackReused.
func (c *core) replayCallback(ctx context.Context, tx *store.Tx, sg *saga.Instance, step, eventID string, hash []byte, res *CallbackResult) (bool, error) {
	var sagaID uuid.UUID
	var had []byte
	err := tx.Conn().QueryRow(ctx, store.SelectCallback, sg.Definition, step, eventID).Scan(&sagaID, &had, &res.Outcome, &res.Detail, &res.ReceivedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("idemsaga: read callback %q of step %q: %w", eventID, step, err)
	case sagaID != sg.ID:
		return false, fmt.Errorf("%w (event %q was received for step %q of saga %s)", ErrCallbackReused, eventID, step, sagaID)
	case !bytes.Equal(had, hash):
		return false, fmt.Errorf("%w (event %q of step %q of saga %s)", ErrCallbackReused, eventID, step, sg.ID)
	}
	res.State, res.Replayed = sg.State, true
	if res.Outcome == CallbackPending {
		// Kept for a step that can no longer wait (given up, cancelled,
		// skipped, or its saga compensating or finished): late now.
		var status string
		err := tx.Conn().QueryRow(ctx, `select coalesce((select status::text from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'), '')`,
			pguuid.Of(sg.ID), step).Scan(&status)
		if err != nil {
			return false, fmt.Errorf("idemsaga: read step %q of saga %s: %w", step, sg.ID, err)
		}
		if sg.Finished() || sg.State == saga.StateCompensating || status == string(saga.StepSucceeded) || status == string(saga.StepFailed) {
			res.Outcome = CallbackLate
			res.Detail = fmt.Sprintf("step %q no longer waits (saga %s is %s); the callback kept for it is recorded and changes nothing", step, sg.ID, sg.State)
			if _, err := tx.Conn().Exec(ctx, store.MarkCallbackLate,
				sg.Definition, step, eventID, res.Detail); err != nil {
				return false, fmt.Errorf("idemsaga: record callback %q of step %q as late: %w", eventID, step, err)
			}
		}
	}
	return true, nil
}

// receiveCallback records a new event and does what the step's status
// says: apply it, keep it pending, or record it as late or superseded.
func (c *core) receiveCallback(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, cb Callback,
	result json.RawMessage, hash []byte, res *CallbackResult, fx *effects) error {
	step := def.Step(idx).Name
	var status string
	var attemptNo int
	err := tx.Conn().QueryRow(ctx, `select status::text, attempt from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'`,
		pguuid.Of(sg.ID), step).Scan(&status, &attemptNo)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("idemsaga: read step %q of saga %s: %w", step, sg.ID, err)
	}
	res.State = sg.State
	switch {
	case status == string(saga.StepWaiting):
		res.Outcome = CallbackApplied
	case sg.Finished() || sg.State == saga.StateCompensating:
		res.Outcome = CallbackLate
		res.Detail = fmt.Sprintf("step %q no longer waits: saga %s is %s; the callback is recorded and changes nothing", step, sg.ID, sg.State)
	case status == string(saga.StepSucceeded) || status == string(saga.StepFailed):
		res.Outcome = CallbackSuperseded
		res.Detail = fmt.Sprintf("step %q was already completed by another event (%s); this one is recorded and changes nothing", step, status)
	default:
		// Not dispatched yet, or its request's outcome not recorded yet.
		res.Outcome = CallbackPending
		res.Detail = fmt.Sprintf("step %q has not recorded its request yet; the callback is kept and applied when it does", step)
	}
	if res.Outcome == CallbackApplied {
		after, m, err := c.callbackMove(sg, def, idx, attemptNo, cb.Error, result)
		if err != nil {
			return err
		}
		res.State, res.Detail = after, describeApplied(step, cb.Error)
		queueComplete(tx, sg.ID, saga.StepKey(sg.ID, step, saga.PhaseForward), attemptNo, cb.Error, result)
		store.QueueMove(tx, m, c.handOffArg(), fx.moved(m))
	}
	var inserted bool
	tx.Queue(store.InsertCallback, func(row pgx.Row) error {
		err := row.Scan(&res.ReceivedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		inserted = err == nil
		return err
	}, sg.Definition, step, cb.EventID, pguuid.Of(sg.ID), hash, cb.Error != "", nullJSONArg(result), nullTextArg(cb.Error), res.Outcome, res.Detail)
	if err := tx.Flush(ctx); err != nil {
		return fmt.Errorf("idemsaga: record callback %q of step %q of saga %s: %w", cb.EventID, step, sg.ID, err)
	}
	if !inserted {
		// The same event id, inserted meanwhile for another saga's step
		// (this saga's lock serializes its own).
		return fmt.Errorf("%w (event %q of step %q, received for another saga)", ErrCallbackReused, cb.EventID, step)
	}
	return nil
}

// callbackMove is the move a callback makes of a waiting step: a success
// moves the saga on with the callback's result; a refusal fails the step
// for good, without effect, and the saga compensates the steps before it.
func (c *core) callbackMove(sg *saga.Instance, def *saga.Definition, idx, attemptNo int, refusal string, result json.RawMessage) (saga.State, *store.Move, error) {
	var m *store.Move
	var err error
	if refusal == "" {
		m, err = c.plan.Success(sg, def, idx, saga.PhaseForward, attemptNo, result)
	} else {
		m, err = c.plan.Failure(sg, def, idx, saga.PhaseForward, attemptNo, "the other system refused the request: "+refusal, compensation.NotDone)
	}
	if err != nil {
		return "", nil, err
	}
	return m.To, m, nil
}

func describeApplied(step, refusal string) string {
	if refusal != "" {
		return fmt.Sprintf("step %q failed: the other system refused its request; the saga compensates the steps before it", step)
	}
	return fmt.Sprintf("step %q completed", step)
}

// queueComplete records a callback's outcome under the step's key, fenced
// on the key still waiting at the attempt: the inbox then holds the
// step's final outcome, so no delivery of its command runs it again.
func queueComplete(tx *store.Tx, sagaID, key uuid.UUID, attemptNo int, refusal string, result json.RawMessage) {
	outcome := "succeeded"
	if refusal != "" {
		outcome = "failed"
	}
	tx.Queue(store.CompleteWaiting, func(row pgx.Row) error {
		var invariant *int
		if err := row.Scan(&invariant); err != nil {
			return fmt.Errorf("record the callback under step key %s: %w", key, err)
		}
		return nil
	}, pguuid.Of(sagaID), pguuid.Of(key), attemptNo, outcome, nullJSONArg(result), nullTextArg(refusal))
}

// wait makes a callback step whose request was accepted wait for its
// callback, in tx, which holds the saga's lock; a callback that came
// first (pending) is applied at once.
func (c *core) wait(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx, attemptNo int, fx *effects) error {
	step := def.Step(idx)
	var eventID, refusal string
	var failed bool
	var result json.RawMessage
	found := false
	tx.Queue(store.WaitForCallback, func(row pgx.Row) error {
		var invariant *int
		return row.Scan(&invariant)
	}, pguuid.Of(sg.ID), step.Name, attemptNo, step.Wait.Milliseconds(), sg.Version)
	tx.Queue(store.FirstPendingCallback, func(row pgx.Row) error {
		err := row.Scan(&eventID, &failed, &result, &refusal)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		found = err == nil
		return err
	}, pguuid.Of(sg.ID), def.Name(), step.Name)
	if err := tx.Flush(ctx); err != nil {
		return fmt.Errorf("make step %q of saga %s wait for its callback: %w", step.Name, sg.ID, err)
	}
	if !found {
		return nil
	}
	if failed && refusal == "" {
		refusal = "refused"
	}
	waiting := *sg
	waiting.Version++
	_, m, err := c.callbackMove(&waiting, def, idx, attemptNo, refusal, result)
	if err != nil {
		return err
	}
	queueComplete(tx, sg.ID, saga.StepKey(sg.ID, step.Name, saga.PhaseForward), attemptNo, refusal, result)
	store.QueueMove(tx, m, c.handOffArg(), fx.moved(m))
	tx.Exec(store.ApplyPendingCallback, nil, def.Name(), step.Name, eventID, describeApplied(step.Name, refusal), pguuid.Of(sg.ID))
	c.metrics.Callbacks.WithLabelValues(def.Name(), step.Name, CallbackApplied).Inc()
	return nil
}

func nullJSONArg(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return string(b)
}

func nullTextArg(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// giveUpOrComplete gives up a step whose attempts ran out (giveUp), but a
// callback step with a callback kept for it is completed by that callback
// instead: the other system's own word that the request took effect,
// which the lost answers to the request never told.
func (c *core) giveUpOrComplete(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, possiblyDone bool, fx *effects) error {
	step := def.Step(idx)
	if step.Kind != saga.CallbackStep || phase != saga.PhaseForward {
		return c.giveUp(ctx, tx, sg, def, idx, phase, attemptNo, reason, possiblyDone, fx)
	}
	var eventID, refusal string
	var failed bool
	var result json.RawMessage
	err := tx.Conn().QueryRow(ctx, store.FirstPendingCallback, pguuid.Of(sg.ID), def.Name(), step.Name).Scan(&eventID, &failed, &result, &refusal)
	if errors.Is(err, pgx.ErrNoRows) {
		return c.giveUp(ctx, tx, sg, def, idx, phase, attemptNo, reason, possiblyDone, fx)
	}
	if err != nil {
		return fmt.Errorf("read the callbacks of step %q of saga %s: %w", step.Name, sg.ID, err)
	}
	// Fence the key first: no attempt may still be running under it.
	s, err := c.settle(ctx, tx, sg.ID, step.Name, phase)
	if err != nil {
		return err
	}
	if s.outcome == "succeeded" {
		return c.giveUp(ctx, tx, sg, def, idx, phase, attemptNo, reason, possiblyDone, fx)
	}
	if failed && refusal == "" {
		refusal = "refused"
	}
	_, m, err := c.callbackMove(sg, def, idx, attemptNo, refusal, result)
	if err != nil {
		return err
	}
	outcome := "succeeded"
	if refusal != "" {
		outcome = "failed"
	}
	tx.Exec(store.CompleteSettled, nil, pguuid.Of(sg.ID), pguuid.Of(saga.StepKey(sg.ID, step.Name, phase)), outcome, nullJSONArg(result), nullTextArg(refusal))
	store.QueueMove(tx, m, c.handOffArg(), fx.moved(m))
	tx.Exec(store.ApplyPendingCallback, nil, def.Name(), step.Name, eventID, describeApplied(step.Name, refusal), pguuid.Of(sg.ID))
	c.metrics.Callbacks.WithLabelValues(def.Name(), step.Name, CallbackApplied).Inc()
	c.log.Info("callback step given up after its attempts, completed by the callback kept for it", "saga_id", sg.ID, "step", step.Name, "event_id", eventID)
	return nil
}
