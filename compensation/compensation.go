// Package compensation plans the rollback of a saga whose forward path
// failed: which steps are compensated, and in which order.
//
// The plan is always the reverse of what started. When forward step f is
// given up, steps 0..f-1 completed: the plan visits f-1, …, 0 and keeps
// every step that has a compensation (steps without one have nothing to
// undo). Step f itself started too; whether it is in the plan depends on
// what the engine knows of its effect when it gives it up:
//
//   - NotDone: it took no effect (a database step's failure, or an
//     external call the other system refused). It is not in the plan.
//   - PossiblyDone: some attempt's outcome at another system is unknown,
//     so it may have taken effect. Its own compensation comes first; a
//     possibly-done step without a compensation cannot be undone, and the
//     plan says to park the saga for a person instead.
//
// Before planning, the engine settles the failed step through the inbox
// in the transaction that gives it up: a tombstone under its key, so no
// late delivery can take effect, and a read of what is recorded there. A
// step that did take effect after all is applied as a success instead.
package compensation

import "github.com/idemsaga/idemsaga/saga"

// Effect is what is known of a given-up step's effect.
type Effect int

const (
	// NotDone: the step took no effect.
	NotDone Effect = iota
	// PossiblyDone: the step may have taken effect.
	PossiblyDone
)

// Plan returns the step indexes to compensate, in order, after forward
// step failed was given up with the given effect. park is set when the
// failed step is possibly done and has no compensation: nothing is to be
// compensated, and the saga stops for a person (saga.StateParked). It
// panics if failed is out of range.
func Plan(def *saga.Definition, failed int, effect Effect) (plan []int, park bool) {
	if failed < 0 || failed >= def.Len() {
		panic("compensation: failed step index out of range")
	}
	if effect == PossiblyDone {
		if def.Step(failed).Compensate == nil {
			return nil, true
		}
		plan = append(plan, failed)
	}
	for i := failed - 1; i >= 0; i-- {
		if def.Step(i).Compensate != nil {
			plan = append(plan, i)
		}
	}
	return plan, false
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
