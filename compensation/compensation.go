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
//   - VerifiedNotDone: attempts' outcomes were unknown, and the step's
//     Verify asked the other system since and heard that the key took no
//     effect. Its own compensation still comes first, if it has one: it
//     voids the key, so that a request still on its way cannot take
//     effect after the answer. A step without one does not park.
//
// A conditional step its condition skipped (saga.Condition) took no
// effect and is never in the plan.
//
// Before planning, the engine settles the failed step through the inbox
// in the transaction that gives it up: a tombstone under its key, so no
// late delivery can take effect, and a read of what is recorded there. A
// step that did take effect after all is applied as a success instead.
package compensation

import (
	"slices"

	"github.com/idemsaga/idemsaga/saga"
)

// Effect is what is known of a given-up step's effect.
type Effect int

const (
	// NotDone: the step took no effect.
	NotDone Effect = iota
	// PossiblyDone: the step may have taken effect.
	PossiblyDone
	// VerifiedNotDone: the other system answered, after the attempts
	// whose outcome was unknown, that the step's key took no effect.
	VerifiedNotDone
)

// Plan returns the step indexes to compensate, in order, after forward
// step failed was given up with the given effect; skipped are the saga's
// skipped steps (saga.Instance.Skipped). park is set when the failed step
// is possibly done and has no compensation: nothing is to be compensated,
// and the saga stops for a person (saga.StateParked). It panics if failed
// is out of range.
func Plan(def *saga.Definition, failed int, effect Effect, skipped []string) (plan []int, park bool) {
	if failed < 0 || failed >= def.Len() {
		panic("compensation: failed step index out of range")
	}
	switch {
	case effect == PossiblyDone && def.Step(failed).Compensate == nil:
		return nil, true
	case effect != NotDone && def.Step(failed).Compensate != nil:
		plan = append(plan, failed)
	}
	for i := failed - 1; i >= 0; i-- {
		if undoes(def, i, skipped) {
			plan = append(plan, i)
		}
	}
	return plan, false
}

// undoes reports whether step i, done before the one given up, is
// compensated: it has a compensation and was not skipped.
func undoes(def *saga.Definition, i int, skipped []string) bool {
	return def.Step(i).Compensate != nil && !slices.Contains(skipped, def.Step(i).Name)
}

// Next returns the step to compensate after step done, or -1 when the
// compensation is complete. It panics if done is out of range. It agrees
// with Plan: for consecutive entries a, b of any plan with the same
// skipped steps, Next(def, a, skipped) == b.
func Next(def *saga.Definition, done int, skipped []string) int {
	if done < 0 || done >= def.Len() {
		panic("compensation: compensated step index out of range")
	}
	for i := done - 1; i >= 0; i-- {
		if undoes(def, i, skipped) {
			return i
		}
	}
	return -1
}

// Completed returns the step indexes to compensate, in order, of a saga
// that completed every step and is compensated whole (its parent
// compensates it, saga.ChildStep): every step with a compensation that
// was not skipped, last first.
func Completed(def *saga.Definition, skipped []string) []int {
	var plan []int
	for i := def.Len() - 1; i >= 0; i-- {
		if undoes(def, i, skipped) {
			plan = append(plan, i)
		}
	}
	return plan
}
