// Package compensation plans the rollback of a saga whose forward path
// failed: which steps are compensated, and in which order.
//
// The plan is always the reverse of what completed. When forward step f
// fails, steps 0..f-1 completed; the plan visits f-1, …, 0 and keeps every
// step that has a compensation. Steps without one have nothing to undo.
//
// The failed step itself is not in the plan: before planning, the engine
// settles it through the inbox in the same transaction that gives it up. It
// records a tombstone under the step's key, so no late delivery can take
// effect, and reads what is recorded there; if the step did take effect
// after all, the engine applies it as a success instead of compensating.
package compensation

import "github.com/idemsaga/idemsaga/saga"

// Plan returns the step indexes to compensate, in order, after forward
// step failed failed. It panics if failed is out of range.
func Plan(def *saga.Definition, failed int) []int {
	if failed < 0 || failed >= def.Len() {
		panic("compensation: failed step index out of range")
	}
	var plan []int
	for i := failed - 1; i >= 0; i-- {
		if def.Step(i).Compensate != nil {
			plan = append(plan, i)
		}
	}
	return plan
}

// Next returns the step to compensate after step done, or -1 when the
// compensation is complete. It panics if done is out of range. It agrees
// with Plan: for consecutive entries a, b of any plan, Next(def, a) == b.
func Next(def *saga.Definition, done int) int {
	if done < 0 || done >= def.Len() {
		panic("compensation: compensated step index out of range")
	}
	for i := done - 1; i >= 0; i-- {
		if def.Step(i).Compensate != nil {
			return i
		}
	}
	return -1
}
