package saga

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
)

// Condition makes a step conditional (Step.When): it decides once, from
// the saga's input and the results of the earlier steps it names, whether
// the step runs. A step whose condition says no is skipped: the saga
// reaches the step's state at once, the step has no key, no attempt, no
// result and nothing to compensate, and the decision is recorded with the
// saga, so that no redelivery, repair or later build of the definition
// decides it again.
//
// The decision is taken while the move that reaches the step is
// recorded (the success of the step before it), so Func must decide from
// sc alone, at once, and never call another system.
type Condition struct {
	// Reads names the earlier steps whose results Func reads through
	// sc.DecodeResult; sc.Results holds theirs and no other. Empty: Func
	// reads the input only. A step named here must come before the
	// conditional step in the definition.
	Reads []string
	// Func returns true when the step runs, false to skip it. sc carries
	// the saga's ID, definition, input and the results of Reads; it has
	// no key, attempt or transaction. Required in a Condition.
	Func func(sc *StepContext) bool

	// elsewhere marks the condition of a definition rebuilt from its
	// description: it exists, in another process's code.
	elsewhere bool
}

// IsZero reports whether c is no condition: the step always runs.
func (c Condition) IsZero() bool { return c.Func == nil && len(c.Reads) == 0 && !c.elsewhere }

// ErrConditionElsewhere is returned when a move must decide a step's
// condition and the definition at hand was rebuilt from its description
// (an admin client without the definition's code).
var ErrConditionElsewhere = errors.New("idemsaga: the step's condition lives in the definition's code, which is not in this process; do this from a process built with it (the worker's own binary)")

// Runs decides whether step i runs for saga id with the given input and
// results (the saga's, as the step before it leaves them): true for a
// step without a condition. A definition rebuilt from its description
// cannot decide a condition: it returns ErrConditionElsewhere.
func (d *Definition) Runs(i int, id uuid.UUID, input json.RawMessage, results map[string]json.RawMessage) (bool, error) {
	s := d.steps[i]
	if s.When.IsZero() {
		return true, nil
	}
	if d.described {
		return false, fmt.Errorf("%w (step %q of %s)", ErrConditionElsewhere, s.Name, d.Ref())
	}
	seen := make(map[string]json.RawMessage, len(s.When.Reads))
	for _, name := range s.When.Reads {
		if r, ok := results[name]; ok {
			seen[name] = r
		}
	}
	sc := &StepContext{SagaID: id, Definition: d.name, Step: s.Name, Phase: PhaseForward, Input: input, Results: seen}
	return s.When.Func(sc), nil
}

// checkCondition reports what is wrong with step i's condition, "" for
// nothing: the first step (or the first group's branches) always runs (a
// saga that should not run is not started), a condition needs its Func,
// and it reads only the results of steps before it (not of its group).
// all indexes every step of steps by name.
func (d *Definition) checkCondition(i int, steps []Step, all map[string]int) string {
	s := steps[i]
	if s.When.IsZero() {
		return ""
	}
	first := i
	for first > 0 && s.Group != "" && steps[first-1].Group == s.Group {
		first--
	}
	if first == 0 {
		return fmt.Sprintf("step %q is in the first step of the saga, which always runs; decide before Start whether the saga runs, or put the condition on a later step", s.Name)
	}
	if s.When.Func == nil && !d.described {
		return fmt.Sprintf("step %q has a condition without its Func", s.Name)
	}
	for _, name := range s.When.Reads {
		j, ok := all[name]
		switch {
		case !ok:
			return fmt.Sprintf("step %q's condition reads step %q, which the definition does not have", s.Name, name)
		case j >= first:
			return fmt.Sprintf("step %q's condition reads the result of step %q, which does not come before it (a branch of the same group runs beside it); a condition reads only earlier results (move the condition after %q, or decide from the input)", s.Name, name, name)
		}
	}
	return ""
}
