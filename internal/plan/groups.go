package plan

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// ErrNeedsSteps is returned for a move of a definition with parallel
// groups that depends on the saga's other steps, planned without them:
// the move is decided under the saga's lock, with its steps read
// (saga.Instance.Steps), by the orchestrator.
var ErrNeedsSteps = errors.New("idemsaga: the move depends on the saga's other steps, which are read under its lock")

// executions are what sg.Steps say of each step, by name, for a
// compensation walk.
func executions(sg *saga.Instance) map[string]compensation.Execution {
	ex := make(map[string]compensation.Execution, len(sg.Steps))
	for _, st := range sg.Steps {
		e := ex[st.Step]
		if st.Phase == saga.PhaseCompensate {
			e.Compensate, e.CompensateUnknown = st.Status, st.PossiblyDone
		} else {
			e.Forward, e.PossiblyDone = st.Status, st.PossiblyDone
		}
		ex[st.Step] = e
	}
	return ex
}

// groupSuccess is the success of step idx of a definition with groups,
// where it differs from a line's: done is set when it decided. A branch
// whose group has other branches still to succeed records its result and
// waits; a compensation, or a forward step of a compensating saga (a
// branch that finished its attempt after its group was given up), walks
// the compensation.
func (p Planner) groupSuccess(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, result json.RawMessage) (m *store.Move, done bool, err error) {
	step := def.Step(idx)
	if phase == saga.PhaseCompensate || sg.State == saga.StateCompensating {
		if sg.Steps == nil {
			return nil, true, ErrNeedsSteps
		}
		if sg.State != saga.StateCompensating {
			return nil, true, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot take the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		m, after := MoveFrom(sg, saga.StateCompensating, step.Name, phase, attemptNo)
		m.Status, m.StepResult = saga.StepSucceeded, result
		ex := executions(sg)
		e := ex[step.Name]
		if phase == saga.PhaseCompensate {
			e.Compensate = saga.StepSucceeded
		} else {
			e.Forward = saga.StepSucceeded
		}
		ex[step.Name] = e
		m, err = p.walk(m, sg, after, def, ex)
		return m, true, err
	}
	first, end := def.Group(idx)
	if end-first == 1 {
		return nil, false, nil
	}
	for b := first; b < end; b++ {
		name := def.Step(b).Name
		if _, ok := sg.Results[name]; b != idx && !ok && !slices.Contains(sg.Skipped, name) {
			// A branch still runs: this one's result is kept, and the
			// saga stays where it is.
			m, _ := MoveFrom(sg, sg.State, step.Name, phase, attemptNo)
			m.Status, m.StepResult = saga.StepSucceeded, result
			m.ResultStep, m.Result = step.Name, result
			return m, true, nil
		}
	}
	return nil, false, nil
}

// groupFailure is Failure for a definition with groups: the compensation
// walks the saga's steps (compensation.Walk), so that every branch of a
// group that succeeded or may have taken effect is undone at once. A
// possibly-done step without a compensation, the one given up or a
// branch beside it, parks the saga. The caller has settled every branch
// of the failed step's group and read the saga's steps.
func (p Planner) groupFailure(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, effect compensation.Effect) (*store.Move, error) {
	if sg.Steps == nil {
		return nil, ErrNeedsSteps
	}
	step := def.Step(idx)
	possibly := effect == compensation.PossiblyDone
	ex := executions(sg)
	e := ex[step.Name]
	if phase == saga.PhaseCompensate {
		if sg.State != saga.StateCompensating {
			return nil, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot fail the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		e.Compensate = saga.StepFailed
		ex[step.Name] = e
		m, after := MoveFrom(sg, saga.StateCompensating, step.Name, phase, attemptNo)
		m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
		return p.walk(m, sg, after, def, ex)
	}
	e.Forward = saga.StepFailed
	e.PossiblyDone = possibly || effect == compensation.VerifiedNotDone && step.Compensate != nil
	ex[step.Name] = e
	if sg.State != saga.StateCompensating {
		first, end := def.Group(idx)
		for b := first; b < end; b++ {
			bs := def.Step(b)
			be := ex[bs.Name]
			if be.Forward == saga.StepFailed && be.PossiblyDone && bs.Compensate == nil {
				m, _ := MoveFrom(sg, saga.StateParked, step.Name, phase, attemptNo)
				m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
				why := reason
				if b != idx {
					why = fmt.Sprintf("its group's branch %q failed: %s", step.Name, reason)
				}
				m.Error = cannotUndo(sg, bs.Name, why)
				Finish(m, string(saga.StateParked))
				return m, nil
			}
		}
	}
	m, after := MoveFrom(sg, saga.StateCompensating, step.Name, phase, attemptNo)
	m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
	if sg.State != saga.StateCompensating {
		if !def.CanTransition(sg.State, saga.StateCompensating) {
			return nil, fmt.Errorf("idemsaga: saga %s cannot start compensating from %q", sg.ID, sg.State)
		}
		m.Error = fmt.Sprintf("step %q failed: %s", step.Name, reason)
		if possibly {
			m.Error = fmt.Sprintf("step %q (key %s) was given up and may have taken effect: %s; it is compensated first", step.Name, saga.StepKey(sg.ID, step.Name, phase), reason)
		}
	}
	return p.walk(m, sg, after, def, ex)
}

// walk makes m, which leaves the saga compensating, follow the walk of
// its compensation from ex: it dispatches the compensations that can
// start (possibly none: others run), or ends the saga compensated, or
// failed on a compensation that could not finish.
func (p Planner) walk(m *store.Move, sg, after *saga.Instance, def *saga.Definition, ex map[string]compensation.Execution) (*store.Move, error) {
	f := compensation.Walk(def, sg.Skipped, ex)
	switch {
	case f.Failed >= 0:
		name := def.Step(f.Failed).Name
		reason, possibly := m.StepError, m.PossiblyDone
		if name != m.Step || m.Phase != saga.PhaseCompensate {
			possibly = ex[name].CompensateUnknown
			for _, st := range sg.Steps {
				if st.Step == name && st.Phase == saga.PhaseCompensate && st.LastError != "" {
					reason = st.LastError
				}
			}
		}
		m.To = saga.StateFailed
		m.Error = cannotFinish(sg, name, reason, possibly)
		Finish(m, string(saga.StateFailed))
		return m, nil
	case f.Done:
		m.To = saga.StateCompensated
		Finish(m, string(saga.StateCompensated))
		return m, nil
	}
	after.State = saga.StateCompensating
	after.Results = maps.Clone(sg.Results)
	return p.dispatchAll(m, after, def, f.Dispatch, saga.PhaseCompensate)
}

// CancelSucceeded is the move of an operator's cancel of a saga of a
// definition with groups whose step idx turned out to have succeeded when
// it was settled: the step succeeds, and the saga compensates what its
// steps did (sg.Steps, read and settled under its lock).
func (p Planner) CancelSucceeded(sg *saga.Instance, def *saga.Definition, idx, attemptNo int, msg string, result json.RawMessage) (*store.Move, error) {
	if sg.Steps == nil {
		return nil, ErrNeedsSteps
	}
	step := def.Step(idx)
	m, after := MoveFrom(sg, saga.StateCompensating, step.Name, saga.PhaseForward, attemptNo)
	m.Status, m.StepResult, m.ResultStep, m.Result, m.Error = saga.StepSucceeded, result, step.Name, result, msg
	ex := executions(sg)
	e := ex[step.Name]
	e.Forward = saga.StepSucceeded
	ex[step.Name] = e
	return p.walk(m, sg, after, def, ex)
}

// Undo returns the compensations that an operator's cancel of parked
// saga sg starts, with its parked step notDone taken as not done: the
// first of its walk (sg.Steps read under its lock), none when nothing is
// to be undone.
func Undo(def *saga.Definition, sg *saga.Instance, notDone string) []int {
	ex := executions(sg)
	e := ex[notDone]
	e.PossiblyDone = false
	ex[notDone] = e
	return compensation.Walk(def, sg.Skipped, ex).Dispatch
}

// UndoCompleted returns the compensations that start the compensation of
// completed saga sg as a whole: the first of its walk (sg.Steps read
// under its lock), none when nothing is to be undone.
func UndoCompleted(def *saga.Definition, sg *saga.Instance) []int {
	return compensation.Walk(def, sg.Skipped, executions(sg)).Dispatch
}
