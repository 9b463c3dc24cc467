package saga

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/google/uuid"
)

// ChildDepthMax bounds how deep children nest: a definition's ChildStep
// runs a child whose own children run theirs, at most ChildDepthMax
// levels below it. A deeper tree is refused when the definition is built.
const ChildDepthMax = 4

// ChildStepsMax bounds a definition's ChildSteps, and so how many
// children one saga runs (its fan-out; a parallel group's child branches
// run theirs at once).
const ChildStepsMax = 16

// ChildKey returns the idempotency key under which the ChildStep whose
// forward key is stepKey starts its child: a redelivered or retried
// attempt of the step finds the same child.
func ChildKey(stepKey uuid.UUID) string { return "child:" + stepKey.String() }

// child is what a definition knows of a ChildStep's child: the definition
// itself when built from code, its name and version always.
type child struct {
	def     *Definition
	name    string
	version int
}

// Child returns the name and version of the definition that step i, a
// ChildStep, runs as its child; ok is false for any other step.
func (d *Definition) Child(i int) (name string, version int, ok bool) {
	c, ok := d.children[i]
	return c.name, c.version, ok
}

// Children returns the definitions the definition's ChildSteps run, as
// built in code, in step order, each once; none for a definition rebuilt
// from its description. An engine runs them with their parent.
func (d *Definition) Children() []*Definition {
	var out []*Definition
	for i := range d.steps {
		if c, ok := d.children[i]; ok && c.def != nil && !slices.Contains(out, c.def) {
			out = append(out, c.def)
		}
	}
	return out
}

// checkChild checks step i, a ChildStep or a step with a Child, and
// records its child; it returns the problem and the field to name.
func (d *Definition) checkChild(i int, s *Step, described bool, childRef string) (problem, field string) {
	if s.Kind != ChildStep {
		if s.Child != nil {
			return fmt.Sprintf("step %q is a %s step; only a saga.ChildStep runs a child (remove Child, or make it a ChildStep)", s.Name, s.Kind), "Child"
		}
		return "", ""
	}
	switch {
	case s.Compensate != nil && !described:
		return fmt.Sprintf("step %q is a child step: its compensation is its child's (a running child is cancelled, a completed one compensated); remove Compensate", s.Name), "Compensate"
	case s.Verify != nil && !described:
		return fmt.Sprintf("step %q is a child step: the engine knows whether it started its child; remove Verify", s.Name), "Verify"
	case !s.Limit.IsZero():
		return fmt.Sprintf("step %q is a child step; a limit bounds calls to other systems, and a child is bounded by its own steps' limits (remove Limit)", s.Name), "Limit"
	case len(d.children) >= ChildStepsMax:
		return fmt.Sprintf("definition %q has more than %d child steps (ChildStepsMax); split it, or let a child run the rest", d.name, ChildStepsMax), "Kind"
	}
	c := child{def: s.Child}
	switch {
	case described:
		name, version, err := ParseRef(childRef)
		if err != nil {
			return fmt.Sprintf("step %q: child %q: %v", s.Name, childRef, err), "Child"
		}
		c.name, c.version = name, version
	case s.Child == nil:
		return fmt.Sprintf("step %q is a child step: set Child to the definition it runs", s.Name), "Child"
	default:
		c.name, c.version = s.Child.name, s.Child.version
		if s.Child.name == d.name || s.Child.tree[d.name] {
			return fmt.Sprintf("step %q runs %s, whose children run %q again: a cycle of children never ends; run the repeated work as a step, or as a child of another name", s.Name, s.Child.Ref(), d.name), "Child"
		}
		if s.Child.depth+1 > ChildDepthMax {
			return fmt.Sprintf("step %q runs %s, whose children nest %d levels deep; with it they would nest %d, over ChildDepthMax (%d): flatten the tree", s.Name, s.Child.Ref(), s.Child.depth, s.Child.depth+1, ChildDepthMax), "Child"
		}
		d.depth = max(d.depth, s.Child.depth+1)
		if d.tree == nil {
			d.tree = map[string]bool{}
		}
		d.tree[s.Child.name] = true
		for n := range s.Child.tree {
			d.tree[n] = true
		}
	}
	if d.children == nil {
		d.children = map[int]child{}
	}
	d.children[i] = c
	// The engine runs both phases (the runner's children); the
	// compensation is there so that the compensation plan includes it.
	s.Compensate = childCompensation
	return "", ""
}

// childCompensation stands for a ChildStep's compensation, which the
// engine runs itself: it refuses to run as a handler.
func childCompensation(_ context.Context, sc *StepContext) (json.RawMessage, error) {
	return nil, Permanent(fmt.Errorf("idemsaga: step %q of saga %q is a child step, compensated by the engine, not by a handler", sc.Step, sc.Definition))
}

// ParseRef parses "name@version", as Ref writes it.
func ParseRef(ref string) (name string, version int, err error) {
	for i := len(ref) - 1; i >= 0; i-- {
		if ref[i] == '@' {
			if _, err := fmt.Sscanf(ref[i+1:], "%d", &version); err != nil || version < 1 || fmt.Sprint(version) != ref[i+1:] {
				return "", 0, fmt.Errorf("want name@version with a version from 1, as Definition.Ref gives it")
			}
			if !namePattern.MatchString(ref[:i]) {
				return "", 0, fmt.Errorf("%q is not a definition name", ref[:i])
			}
			return ref[:i], version, nil
		}
	}
	return "", 0, fmt.Errorf("want name@version, as Definition.Ref gives it")
}
