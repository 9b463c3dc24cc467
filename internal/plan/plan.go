// Package plan decides what a saga does next: the move that a step's
// success or failure makes (the state it reaches, the step it dispatches,
// the compensations in reverse order, a park for a person), and the
// command of each attempt. It reads nothing and writes nothing; the
// orchestrator, the reaper, the repairs and the step runner apply its
// moves through the store.
//
// The next wave changes it, not its callers: a parallel group's success
// dispatches every branch and reaches the group's state when the last
// branch succeeds; a conditional step's decision is recorded in the move
// that reaches it; a child saga's step dispatches a start.
package plan

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// Planner plans the moves of one engine's sagas.
type Planner struct {
	// Subjects names the commands' subjects.
	Subjects wire.Subjects
	// LeaseGrace is added to a step's timeout for its lease.
	LeaseGrace time.Duration
	// Sealer opens the input and results a condition reads.
	Sealer *seal.Sealer
}

// LeaseMillis is the lease of an attempt under policy, in milliseconds.
func (p Planner) LeaseMillis(policy saga.RetryPolicy) int64 {
	return (policy.Timeout + p.LeaseGrace).Milliseconds()
}

// PolicyOf is the retry policy of step idx in phase.
func PolicyOf(def *saga.Definition, idx int, phase saga.Phase) saga.RetryPolicy {
	if phase == saga.PhaseCompensate {
		return def.Step(idx).CompensateRetry
	}
	return def.Step(idx).Retry
}

// Command encodes the command of one attempt. sg is the saga as the
// transaction that writes the command leaves it: the command carries its
// state and version, so that a success can be applied in its step without
// a read.
// verify makes it an attempt that asks the step's Verify alone
// (wire.Command.Verify).
func (p Planner) Command(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int, verify bool) (subject, msgID string, payload []byte, err error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	cmd := wire.Command{
		SagaID: sg.ID, Definition: sg.Definition, DefinitionVersion: def.Version(), Step: step.Name, Phase: phase,
		Key: key, Attempt: attempt, Input: sg.Input, Results: sg.Results,
		State: sg.State, Version: sg.Version, Skipped: sg.Skipped, Verify: verify,
	}
	payload, err = json.Marshal(cmd)
	if err != nil {
		return "", "", nil, fmt.Errorf("encode command: %w", err)
	}
	return p.Subjects.Command(sg.Definition, step.Name), "c-" + saga.MessageID(key, attempt), payload, nil
}

// Dispatch describes attempt 1 of step idx in the given phase, its command
// written from after, the saga as the dispatching move leaves it.
func (p Planner) Dispatch(after *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) (*store.Dispatch, error) {
	subject, msgID, payload, err := p.Command(after, def, idx, phase, 1, false)
	if err != nil {
		return nil, err
	}
	name := def.Step(idx).Name
	return &store.Dispatch{
		Step: name, Phase: phase, Index: idx, Key: saga.StepKey(after.ID, name, phase),
		LeaseMillis: p.LeaseMillis(PolicyOf(def, idx, phase)), Subject: subject, MsgID: msgID, Payload: payload,
	}, nil
}

// MoveFrom starts a move of sg, as it is now, to `to`; after is sg as the
// move leaves it, for the next command.
func MoveFrom(sg *saga.Instance, to saga.State, step string, phase saga.Phase, attemptNo int) (*store.Move, *saga.Instance) {
	m := &store.Move{Saga: sg.ID, Definition: sg.Definition, From: sg.State, Version: sg.Version, To: to,
		Step: step, Phase: phase, Attempt: attemptNo}
	after := *sg
	after.State, after.Version = to, sg.Version+1
	return m, &after
}

// Finish marks m as finishing its saga in state to.
func Finish(m *store.Move, outcome string) {
	m.Finished, m.Outcome = true, outcome
}

// Success is the move of a step's success: a forward step moves the
// saga to its state and dispatches the next (or finishes the saga); a
// compensation dispatches the next compensation (or ends compensated).
func (p Planner) Success(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, result json.RawMessage) (*store.Move, error) {
	step := def.Step(idx)
	if def.HasGroups() {
		if m, done, err := p.groupSuccess(sg, def, idx, phase, attemptNo, result); done || err != nil {
			return m, err
		}
	}
	if phase == saga.PhaseCompensate {
		next := compensation.Next(def, idx, sg.Skipped)
		to := saga.StateCompensating
		if next < 0 {
			to = saga.StateCompensated
		}
		if sg.State != saga.StateCompensating {
			return nil, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot take the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		m, after := MoveFrom(sg, to, step.Name, phase, attemptNo)
		m.Status, m.StepResult = saga.StepSucceeded, result
		if next < 0 {
			Finish(m, string(saga.StateCompensated))
			return m, nil
		}
		var err error
		m.Next, err = p.Dispatch(after, def, next, saga.PhaseCompensate)
		return m, err
	}
	m, after := MoveFrom(sg, step.Reaches, step.Name, phase, attemptNo)
	m.Status, m.StepResult = saga.StepSucceeded, result
	m.ResultStep, m.Result = step.Name, result
	after.Results = maps.Clone(sg.Results)
	if after.Results == nil {
		after.Results = map[string]json.RawMessage{}
	}
	if len(result) == 0 {
		result = json.RawMessage("null")
	}
	after.Results[step.Name] = result
	_, end := def.Group(idx)
	return p.forward(m, sg, after, def, end)
}

// forward makes m, which reaches the state of the steps before next,
// dispatch the next steps that run: the conditions of the steps from
// next on are decided here, once, and a skipped step's state (or a
// group's, all of whose branches are skipped) is reached with m. A
// group's branches that run are dispatched together. With no step left,
// m finishes the saga.
func (p Planner) forward(m *store.Move, sg, after *saga.Instance, def *saga.Definition, next int) (*store.Move, error) {
	var run []int
	for next < def.Len() && len(run) == 0 {
		first, end := def.Group(next)
		for b := first; b < end; b++ {
			runs, err := p.runs(def, b, sg.ID, sg.Input, after.Results)
			if err != nil {
				return nil, err
			}
			if runs {
				run = append(run, b)
			} else {
				m.Skip = append(m.Skip, def.Step(b).Name)
			}
		}
		if len(run) == 0 {
			m.To = def.Step(first).Reaches
		}
		next = end
	}
	if !def.CanTransition(sg.State, m.To) {
		return nil, fmt.Errorf("idemsaga: saga %s cannot move from %q to %q", sg.ID, sg.State, m.To)
	}
	after.State = m.To
	if len(m.Skip) > 0 {
		after.Skipped = append(slices.Clip(sg.Skipped), m.Skip...)
	}
	if len(run) == 0 {
		Finish(m, "completed")
		return m, nil
	}
	return p.dispatchAll(m, after, def, run, saga.PhaseForward)
}

// dispatchAll makes m dispatch steps idx in phase, together: the first
// as m.Next, the rest as m.Also.
func (p Planner) dispatchAll(m *store.Move, after *saga.Instance, def *saga.Definition, idx []int, phase saga.Phase) (*store.Move, error) {
	for i, b := range idx {
		d, err := p.Dispatch(after, def, b, phase)
		if err != nil {
			return nil, err
		}
		if i == 0 {
			m.Next = d
		} else {
			m.Also = append(m.Also, d)
		}
	}
	return m, nil
}

// Failure is the move of a step given up with reason: a forward step
// compensates the steps before it in reverse order, itself first when it
// is possibly done; a possibly-done step without a compensation parks the
// saga; a compensation that cannot finish ends the saga failed.
func (p Planner) Failure(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, effect compensation.Effect) (*store.Move, error) {
	if def.HasGroups() {
		return p.groupFailure(sg, def, idx, phase, attemptNo, reason, effect)
	}
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	possibly := effect == compensation.PossiblyDone
	if phase == saga.PhaseCompensate {
		if sg.State != saga.StateCompensating {
			return nil, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot fail the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		m, _ := MoveFrom(sg, saga.StateFailed, step.Name, phase, attemptNo)
		m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
		m.Error = cannotFinish(sg, step.Name, reason, possibly)
		Finish(m, string(saga.StateFailed))
		return m, nil
	}
	if !def.CanTransition(sg.State, saga.StateCompensating) {
		return nil, fmt.Errorf("idemsaga: saga %s cannot start compensating from %q", sg.ID, sg.State)
	}
	plan, park := compensation.Plan(def, idx, effect, sg.Skipped)
	if park {
		m, _ := MoveFrom(sg, saga.StateParked, step.Name, phase, attemptNo)
		m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, true
		m.Error = cannotUndo(sg, step.Name, reason)
		Finish(m, string(saga.StateParked))
		return m, nil
	}
	to := saga.StateCompensating
	if len(plan) == 0 {
		to = saga.StateCompensated
	}
	m, after := MoveFrom(sg, to, step.Name, phase, attemptNo)
	m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
	m.Error = fmt.Sprintf("step %q failed: %s", step.Name, reason)
	switch {
	case possibly:
		m.Error = fmt.Sprintf("step %q (key %s) was given up and may have taken effect: %s; it is compensated first", step.Name, key, reason)
	case effect == compensation.VerifiedNotDone && step.Compensate != nil:
		m.Error = fmt.Sprintf("step %q (key %s) was given up; its Verify found the key took no effect: %s; it is compensated first, to void the key against a request still on its way", step.Name, key, reason)
	}
	return p.Compensate(m, after, def, plan)
}

// Compensate makes m start plan: with nothing to undo the saga ends
// compensated; otherwise it is compensating and m dispatches the plan's
// first compensation.
func (p Planner) Compensate(m *store.Move, after *saga.Instance, def *saga.Definition, plan []int) (*store.Move, error) {
	if len(plan) == 0 {
		Finish(m, string(saga.StateCompensated))
		return m, nil
	}
	after.State = saga.StateCompensating
	var err error
	m.Next, err = p.Dispatch(after, def, plan[0], saga.PhaseCompensate)
	return m, err
}

// Exhausted is the reason of a step whose attempts ran out.
func Exhausted(attempts int, last string) string {
	return fmt.Sprintf("%d attempts exhausted; last error: %s", attempts, last)
}

// cannotFinish is the error of a saga whose compensation of step could
// not finish.
func cannotFinish(sg *saga.Instance, step, reason string, possibly bool) string {
	how := ""
	if possibly {
		how = " (it may have taken effect: an attempt's outcome is unknown)"
	}
	return fmt.Sprintf("compensation of step %q (key %s) cannot finish%s: %s; a person must repair the effects, then resume the compensation with `retry %s`, "+
		"or, having undone the step by hand, go on with the next compensation with `skip %s --step %s`, or close the saga as handled with `close %s`",
		step, saga.StepKey(sg.ID, step, saga.PhaseCompensate), how, reason, sg.ID, sg.ID, step, sg.ID)
}

// cannotUndo is the error of a saga parked on step, possibly done and
// without a compensation.
func cannotUndo(sg *saga.Instance, step, reason string) string {
	return fmt.Sprintf("step %q may have taken effect at the other system (an attempt's outcome is unknown; its key is %s) and has no compensation, so nothing was undone: %s; "+
		"check the other system under that key, then retry the step with `retry %s` (the same key: the other system answers with what it did), "+
		"or, if it did take effect, go on with `skip %s --step %s --result JSON` (its result), "+
		"or, if it did not, compensate the steps before it with `cancel %s`, or close the saga as handled with `close %s`",
		step, saga.StepKey(sg.ID, step, saga.PhaseForward), reason, sg.ID, sg.ID, step, sg.ID, sg.ID)
}

// runs decides step i's condition on the saga's data, opened.
func (p Planner) runs(def *saga.Definition, i int, id uuid.UUID, input json.RawMessage, results map[string]json.RawMessage) (bool, error) {
	if def.Step(i).When.IsZero() || !p.Sealer.On() {
		return def.Runs(i, id, input, results)
	}
	in, err := p.Sealer.Open(id, input)
	if err != nil {
		return false, err
	}
	res, err := p.Sealer.OpenAll(id, results)
	if err != nil {
		return false, err
	}
	return def.Runs(i, id, in, res)
}
