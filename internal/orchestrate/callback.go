package orchestrate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/google/uuid"
	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/jackc/pgx/v5"
)

// Callback is another system's answer to a callback step's request, as
// the engine's Client checked it (engine.Callback): its event id, and the
// error the other system gave (empty for a success).
type Callback struct {
	EventID, Error string
}

// Callback outcomes (engine.CallbackResult.Outcome).
const (
	CallbackApplied    = "applied"
	CallbackPending    = "pending"
	CallbackLate       = "late"
	CallbackSuperseded = "superseded"
)

// CallbackResult is what a callback did (engine.CallbackResult).
type CallbackResult struct {
	SagaID          uuid.UUID
	Step, EventID   string
	Outcome, Detail string
	State           saga.State
	ReceivedAt      time.Time
	Replayed        bool
}

// ErrInvalidCallback is returned for a callback that is not well formed,
// or whose result its step's CheckCallback refused. Nothing is written.
var ErrInvalidCallback = errors.New("idemsaga: invalid callback")

// ErrNotCallbackStep is returned for a callback to a step that is not a
// callback step.
var ErrNotCallbackStep = errors.New("idemsaga: the step is not a callback step")

// Complete applies a callback to step of saga id, whose definition the
// caller resolved, in the caller's transaction in (nil: one of its own):
// result is its canonical result, hash the digest of its body that later
// deliveries of the event must match.
func (c *Core) Complete(ctx context.Context, in pgx.Tx, id uuid.UUID, step string, cb Callback, result json.RawMessage, hash []byte) (CallbackResult, error) {
	var res CallbackResult
	var def *saga.Definition
	var refused bool
	fx := &effects{}
	err := c.withSagaLocked(ctx, in, id, "complete a step of", func(tx *store.Tx, sg *saga.Instance) error {
		fx = &effects{}
		res = CallbackResult{SagaID: id, Step: step, EventID: cb.EventID}
		var err error
		if def, err = c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion); err != nil {
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
		if check := def.Step(idx).CheckCallback; check != nil && cb.Error == "" {
			sc := &saga.StepContext{SagaID: sg.ID, Definition: sg.Definition, Step: step, Phase: saga.PhaseForward,
				Key: saga.StepKey(sg.ID, step, saga.PhaseForward), Input: bytes.Clone(sg.Input), Results: maps.Clone(sg.Results)}
			if err := check(ctx, sc, result); err != nil {
				refused = true
				return fmt.Errorf("%w: the step's check refused its result: %w", ErrInvalidCallback, err)
			}
		}
		return c.receiveCallback(ctx, tx, sg, def, idx, cb, result, hash, &res, fx)
	}, func() { c.emit(fx) })
	if refused {
		c.metrics.Callbacks.WithLabelValues(def.Name(), step, "refused").Inc()
	}
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

// ErrCallbackReused is returned for an event id already received with
// another body, or for another saga's step. Nothing is written.
var ErrCallbackReused = errors.New("idemsaga: this callback event id was already received with another body; an event id names one event")

// replayCallback answers an event already received from its record; an
// event id received with another body, or for another saga's step, is
// ErrCallbackReused.
func (c *Core) replayCallback(ctx context.Context, tx *store.Tx, sg *saga.Instance, step, eventID string, hash []byte, res *CallbackResult) (bool, error) {
	var sagaID uuid.UUID
	var had []byte
	err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.SelectCallback, sg.Definition, step, eventID).Scan(&sagaID, &had, &res.Outcome, &res.Detail, &res.ReceivedAt)
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
		err := c.schema.Q(tx.Conn()).QueryRow(ctx, `select coalesce((select status::text from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'), '')`,
			pguuid.Of(sg.ID), step).Scan(&status)
		if err != nil {
			return false, fmt.Errorf("idemsaga: read step %q of saga %s: %w", step, sg.ID, err)
		}
		if sg.Finished() || sg.State == saga.StateCompensating || status == string(saga.StepSucceeded) || status == string(saga.StepFailed) {
			res.Outcome = CallbackLate
			res.Detail = fmt.Sprintf("step %q no longer waits (saga %s is %s); the callback kept for it is recorded and changes nothing", step, sg.ID, sg.State)
			if _, err := c.schema.Q(tx.Conn()).Exec(ctx, store.MarkCallbackLate,
				sg.Definition, step, eventID, res.Detail); err != nil {
				return false, fmt.Errorf("idemsaga: record callback %q of step %q as late: %w", eventID, step, err)
			}
		}
	}
	return true, nil
}

// receiveCallback records a new event and does what the step's status
// says: apply it, keep it pending, or record it as late or superseded.
func (c *Core) receiveCallback(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, cb Callback,
	result json.RawMessage, hash []byte, res *CallbackResult, fx *effects) error {
	step := def.Step(idx).Name
	var status string
	var attemptNo int
	err := c.schema.Q(tx.Conn()).QueryRow(ctx, `select status::text, attempt from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'`,
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
		store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
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
func (c *Core) callbackMove(sg *saga.Instance, def *saga.Definition, idx, attemptNo int, refusal string, result json.RawMessage) (saga.State, *store.Move, error) {
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
func (c *Core) wait(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, fx *effects) error {
	step := def.Step(idx)
	if step.Kind == saga.ChildStep {
		return c.waitForChild(ctx, tx, sg, def, idx, phase, attemptNo, fx)
	}
	var eventID, refusal string
	var failed bool
	var result json.RawMessage
	found := false
	tx.Queue(store.WaitForCallback, func(row pgx.Row) error {
		var invariant *int
		return row.Scan(&invariant)
	}, pguuid.Of(sg.ID), step.Name, attemptNo, step.Wait.Milliseconds(), sg.Version, string(saga.PhaseForward))
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
	store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
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
func (c *Core) giveUpOrComplete(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, possiblyDone bool, fx *effects) error {
	step := def.Step(idx)
	if step.Kind != saga.CallbackStep || phase != saga.PhaseForward {
		return c.giveUp(ctx, tx, sg, def, idx, phase, attemptNo, reason, possiblyDone, fx)
	}
	var eventID, refusal string
	var failed bool
	var result json.RawMessage
	err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.FirstPendingCallback, pguuid.Of(sg.ID), def.Name(), step.Name).Scan(&eventID, &failed, &result, &refusal)
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
	store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
	tx.Exec(store.ApplyPendingCallback, nil, def.Name(), step.Name, eventID, describeApplied(step.Name, refusal), pguuid.Of(sg.ID))
	c.metrics.Callbacks.WithLabelValues(def.Name(), step.Name, CallbackApplied).Inc()
	c.log.Info("callback step given up after its attempts, completed by the callback kept for it", "saga_id", sg.ID, "step", step.Name, "event_id", eventID)
	return nil
}
