package compensation

import (
	"slices"

	"github.com/idemsaga/idemsaga/saga"
)

// Execution is what the engine knows of one step of a saga, from its
// rows: the status of its forward execution and of its compensation
// ("" for one that never started), and whether the forward step may
// have taken effect.
type Execution struct {
	Forward      saga.StepStatus
	PossiblyDone bool
	Compensate   saga.StepStatus
	// CompensateUnknown: an attempt of the compensation had an unknown
	// outcome.
	CompensateUnknown bool
}

// Frontier is where a saga's compensation stands (Walk).
type Frontier struct {
	// Dispatch are the compensations to start now, concurrently: the
	// branches of one parallel group, or one step.
	Dispatch []int
	// Done: every compensation finished; the saga is compensated.
	Done bool
	// Failed is the step whose compensation failed for good, once no
	// other runs beside it: the saga fails. -1 for none.
	Failed int
}

// Walk finds the frontier of a saga's compensation from what its steps
// did (by step name) in a definition with parallel groups: the steps
// that started are compensated in reverse, a group at a time. Of a
// group, every branch that succeeded or may have taken effect and has a
// compensation is compensated, all at once; the steps before the group
// wait until each of those finished. A branch whose forward execution
// still runs holds its group (the engine settles every branch before it
// compensates a group). A compensation that failed ends the walk once
// none runs beside it. Skipped steps took no effect.
//
// Without groups, Walk agrees with Plan and Next: it dispatches each
// entry of the plan in turn.
func Walk(def *saga.Definition, skipped []string, ex map[string]Execution) Frontier {
	top := -1
	for i := def.Len() - 1; i >= 0; i-- {
		if ex[def.Step(i).Name].Forward != "" {
			top = i
			break
		}
	}
	for i := top; i >= 0; {
		first, end := def.Group(i)
		var dispatch []int
		busy, failed := false, -1
		for b := first; b < end; b++ {
			step := def.Step(b)
			e := ex[step.Name]
			if e.Forward == "" || slices.Contains(skipped, step.Name) {
				continue
			}
			// A compensation that started is waited for, or ends the
			// walk, whatever is known of the step since.
			switch {
			case running(e.Forward) || running(e.Compensate):
				busy = true
				continue
			case e.Compensate == saga.StepFailed:
				failed = b
				continue
			case e.Compensate != "":
				continue
			}
			if step.Compensate != nil && (e.Forward == saga.StepSucceeded || e.Forward == saga.StepFailed && e.PossiblyDone) {
				dispatch = append(dispatch, b)
			}
		}
		switch {
		case failed >= 0 && busy:
			return Frontier{Failed: -1}
		case failed >= 0:
			return Frontier{Failed: failed}
		case len(dispatch) > 0 || busy:
			return Frontier{Dispatch: dispatch, Failed: -1}
		}
		i = first - 1
	}
	return Frontier{Done: true, Failed: -1}
}

// running reports a status of an execution still under way.
func running(s saga.StepStatus) bool {
	return s == saga.StepDispatched || s == saga.StepRetrying || s == saga.StepWaiting
}
