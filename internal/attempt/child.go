package attempt

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/saga"
)

// Children runs the two phases of a saga.ChildStep, which the engine
// performs itself: it starts, cancels and compensates child sagas. The
// runner calls it in the place of a handler, with the attempt's context.
type Children interface {
	// Start starts the child that sc, a forward attempt of step, runs:
	// definition name at version, with input, under saga.ChildKey of
	// sc.Key, linked to its parent. It is fenced by the attempt: an
	// attempt given up or taken over starts nothing. A child already
	// started under the key is returned as it is.
	Start(ctx context.Context, sc *saga.StepContext, name string, version int, input json.RawMessage) (uuid.UUID, error)
	// Find returns the child the forward attempts of sc's step started,
	// if any.
	Find(ctx context.Context, sc *saga.StepContext, name string) (id uuid.UUID, found bool, err error)
	// Undo orders the child of sc's step, a compensation attempt, to be
	// compensated: a running or parked child is cancelled, a completed
	// one compensated; one compensating or ended already is left as it
	// is. found is false when the step started no child.
	Undo(ctx context.Context, sc *saga.StepContext, name string) (id uuid.UUID, found bool, err error)
}

// childResult is what a child step's attempt records under its key: the
// child it started (or ordered to compensate), for which the step waits.
type childResult struct {
	Child uuid.UUID `json:"child"`
}

// childHandlers returns step, a saga.ChildStep of def, with the phases
// the engine runs in place of handlers: the forward builds the child's
// input (the step's own Forward, or the parent's input) and starts the
// child; the compensation orders the child compensated; Verify finds
// the child. A phase that leaves the step waiting for its child returns
// the child's ID as its result; a compensation that found no child
// returns none, and succeeds.
func (r *Runner) childHandlers(def *saga.Definition, idx int, step saga.Step) saga.Step {
	name, version, _ := def.Child(idx)
	ch := r.cfg.Children
	if ch == nil {
		missing := func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, fmt.Errorf("step %q of %s is a child step, and this worker runs no children (a runner without Config.Children)", step.Name, def.Ref())
		}
		step.Forward, step.Compensate, step.Verify = missing, missing, nil
		return step
	}
	build := step.Forward
	step.Forward = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		input := sc.Input
		if build != nil {
			var err error
			if input, err = build(ctx, sc); err != nil {
				if saga.IsPermanent(err) {
					return nil, err
				}
				// No child started: the attempt took no effect.
				return nil, saga.NotApplied(fmt.Errorf("build the input of child %s: %w", saga.Ref(name, version), err))
			}
		}
		id, err := ch.Start(ctx, sc, name, version, input)
		if err != nil {
			return nil, err
		}
		return json.Marshal(childResult{Child: id})
	}
	step.Verify = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		id, found, err := ch.Find(ctx, sc, name)
		switch {
		case err != nil:
			return nil, err
		case !found:
			return nil, saga.NotApplied(fmt.Errorf("no child %s was started under key %s", name, saga.ChildKey(saga.StepKey(sc.SagaID, sc.Step, saga.PhaseForward))))
		}
		return json.Marshal(childResult{Child: id})
	}
	step.Compensate = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		id, found, err := ch.Undo(ctx, sc, name)
		if err != nil || !found {
			return nil, err
		}
		return json.Marshal(childResult{Child: id})
	}
	return step
}
