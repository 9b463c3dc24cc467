// Package compensation plans the rollback of a saga whose forward path
// failed: which steps are compensated, and in which order.
//
// The plan is always the reverse of what started. When forward step f
// fails, the steps 0..f-1 completed and step f may or may not have taken
// effect (its outcome can be unknown). The plan visits f, f-1, …, 0 and
// keeps the failing step f (so its key is tombstoned and a late delivery of
// its forward command does nothing, and, if it did take effect, it is
// undone) and every earlier step that has a compensation. Steps without a
// compensation have nothing to undo and are skipped.
package compensation

import "github.com/idemsaga/idemsaga/saga"

// Plan returns the step indexes to compensate, in order, after forward
// step failed failed. It panics if failed is out of range.
func Plan(def *saga.Definition, failed int) []int {
	if failed < 0 || failed >= def.Len() {
		panic("compensation: failed step index out of range")
	}
	plan := []int{failed}
	for i := failed - 1; i >= 0; i-- {
		if def.Step(i).Compensate != nil {
			plan = append(plan, i)
		}
	}
	return plan
}

// Next returns the step to compensate after step done, or -1 when the
// compensation is complete. It panics if done is out of range. It agrees with Plan: for consecutive entries
// a, b of any plan, Next(def, a) == b.
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
