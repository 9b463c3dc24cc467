package orchestrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/plan"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// A child step (saga.ChildStep) waits, as a callback step does, for its
// child's end: in the forward phase once the child started, in the
// compensation once the child was ordered to compensate. The child's end
// is applied to the parent under the parent's lock, by whichever comes
// second: the step beginning to wait (which reads the child), or the
// child's end (ChildEnded, right after the child's move commits, and the
// reaper's sweep for an end whose process stopped before it told the
// parent). The parent's lock orders the two, so one of them always sees
// the other.

// childRow is what a parent reads of its child.
type childRow struct {
	id       uuid.UUID
	state    saga.State
	finished bool
	err      string
	results  map[string]json.RawMessage
}

// completed reports a child that finished every step.
func (ch childRow) completed() bool {
	switch ch.state {
	case saga.StateCompensated, saga.StateFailed, saga.StateParked, saga.StateClosed:
		return false
	}
	return ch.finished
}

// childEnd is what a child's state decides for its parent's step in one
// phase.
type childEnd struct {
	decided, success bool
	result           json.RawMessage
	reason           string
	effect           compensation.Effect
}

// decide reads the child's state as the end of its parent's step in
// phase; found is false when the step started no child.
func (ch childRow) decide(phase saga.Phase, found bool) (childEnd, error) {
	if phase == saga.PhaseCompensate {
		switch {
		case !found, ch.state == saga.StateCompensated, ch.state == saga.StateClosed:
			return childEnd{decided: true, success: true}, nil
		case ch.state == saga.StateFailed:
			return childEnd{decided: true, reason: fmt.Sprintf("child saga %s could not finish its compensation (%s); repair the child first (`show %s`), then retry this saga", ch.id, ch.err, ch.id)}, nil
		}
		return childEnd{}, nil
	}
	switch {
	case !found:
		return childEnd{}, nil
	case ch.completed():
		result, err := json.Marshal(ch.results)
		if err != nil {
			return childEnd{}, fmt.Errorf("encode the results of child saga %s: %w", ch.id, err)
		}
		return childEnd{decided: true, success: true, result: result}, nil
	case ch.state == saga.StateCompensated:
		return childEnd{decided: true, reason: fmt.Sprintf("child saga %s failed and was compensated: %s", ch.id, ch.err), effect: compensation.NotDone}, nil
	case ch.state == saga.StateFailed, ch.state == saga.StateClosed:
		return childEnd{decided: true, reason: fmt.Sprintf("child saga %s ended %s, and its effects may remain: %s", ch.id, ch.state, ch.err), effect: compensation.PossiblyDone}, nil
	}
	return childEnd{}, nil
}

// readChild reads the child of step of saga sagaID, a child step whose
// child is definition name.
func readChild(ctx context.Context, q store.Row, sagaID uuid.UUID, step, name string) (childRow, bool, error) {
	var ch childRow
	var state string
	err := q.QueryRow(ctx, store.SelectChildByKey, name, saga.ChildKey(saga.StepKey(sagaID, step, saga.PhaseForward))).
		Scan(&ch.id, &state, &ch.finished, &ch.err, &ch.results)
	if errors.Is(err, pgx.ErrNoRows) {
		return ch, false, nil
	}
	if err != nil {
		return ch, false, fmt.Errorf("read the child of step %q of saga %s: %w", step, sagaID, err)
	}
	ch.state = saga.State(state)
	return ch, true, nil
}

// applyChild applies what the child of step idx decides, if it has
// decided, to sg, whose step waits in phase at attemptNo; tx holds sg's
// lock. It reports whether it moved the step.
func (c *Core) applyChild(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, fx *effects) (bool, error) {
	step := def.Step(idx)
	name, _, _ := def.Child(idx)
	ch, found, err := readChild(ctx, tx.Schema().Q(tx.Conn()), sg.ID, step.Name, name)
	if err != nil {
		return false, err
	}
	if found && c.sealer.On() {
		// The child's results are sealed for the child; the step's
		// result, made of them, is sealed for the parent.
		if ch.results, err = c.sealer.OpenAll(ch.id, ch.results); err != nil {
			return false, err
		}
	}
	end, err := ch.decide(phase, found)
	if err != nil || !end.decided {
		return false, err
	}
	if end.success && len(end.result) > 0 {
		if end.result, err = c.sealer.Seal(sg.ID, end.result); err != nil {
			return false, err
		}
	}
	var m *store.Move
	if end.success {
		m, err = c.plan.Success(sg, def, idx, phase, attemptNo, end.result)
	} else {
		m, err = c.plan.Failure(sg, def, idx, phase, attemptNo, end.reason, end.effect)
	}
	if err != nil {
		return false, err
	}
	key := saga.StepKey(sg.ID, step.Name, phase)
	if !end.success && phase == saga.PhaseForward && end.effect == compensation.NotDone {
		tx.Queue(store.CompleteChildNotDone, func(row pgx.Row) error {
			var invariant *int
			return row.Scan(&invariant)
		}, pguuid.Of(sg.ID), pguuid.Of(key), attemptNo, end.reason)
	} else {
		queueComplete(tx, sg.ID, key, attemptNo, end.reason, end.result)
	}
	store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
	c.metrics.ChildEnds.WithLabelValues(def.Name(), step.Name, string(phase), childOutcome(end)).Inc()
	return true, nil
}

func childOutcome(end childEnd) string {
	switch {
	case end.success:
		return "succeeded"
	case end.effect == compensation.PossiblyDone:
		return "possibly_done"
	}
	return "failed"
}

// waitForChild makes child step idx of sg, whose attempt started its
// child (or ordered it to compensate), wait for the child's end in
// phase, in tx, which holds the saga's lock; a child that ended already
// is applied at once.
func (c *Core) waitForChild(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, fx *effects) error {
	step := def.Step(idx)
	tx.Queue(store.WaitForCallback, func(row pgx.Row) error {
		var invariant *int
		return row.Scan(&invariant)
	}, pguuid.Of(sg.ID), step.Name, attemptNo, step.Wait.Milliseconds(), sg.Version, string(phase))
	if err := tx.Flush(ctx); err != nil {
		return fmt.Errorf("make step %q (%s) of saga %s wait for its child: %w", step.Name, phase, sg.ID, err)
	}
	waiting := *sg
	waiting.Version++
	_, err := c.applyChild(ctx, tx, &waiting, def, idx, phase, attemptNo, fx)
	return err
}

// ChildEnded applies the end of saga id, if it is a child, to its
// parent's step that waits for it. It is idempotent: an end applied
// already, or a step that does not wait (any more), changes nothing.
func (c *Core) ChildEnded(ctx context.Context, id uuid.UUID) error {
	var parent uuid.UUID
	var step string
	err := c.DB().QueryRow(ctx, store.SelectParentOf, pguuid.Of(id)).Scan(&parent, &step)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("idemsaga: read the parent of saga %s: %w", id, err)
	}
	fx := &effects{}
	err = c.withSagaLocked(ctx, nil, parent, "apply a child's end to", func(tx *store.Tx, sg *saga.Instance) error {
		fx = &effects{}
		def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return err
		}
		idx := def.StepIndex(step)
		if idx < 0 || def.Step(idx).Kind != saga.ChildStep {
			return fmt.Errorf("idemsaga: saga %s names step %q of its parent %s, which is not a child step of %s", id, step, parent, def.Ref())
		}
		var phase string
		var attemptNo int
		err = c.schema.Q(tx.Conn()).QueryRow(ctx, `select phase::text, attempt from idemsaga.steps
where saga_id = $1 and step = $2 and status = 'waiting'`, pguuid.Of(parent), step).Scan(&phase, &attemptNo)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // not waiting: nothing to apply
		}
		if err != nil {
			return fmt.Errorf("idemsaga: read step %q of saga %s: %w", step, parent, err)
		}
		_, err = c.applyChild(ctx, tx, sg, def, idx, saga.Phase(phase), attemptNo, fx)
		return err
	}, func() { c.emit(fx) })
	if errors.Is(err, saga.ErrNotFound) {
		return nil // the parent is gone (retention)
	}
	return err
}

// childEnds takes the IDs of children that finished, for the engine's
// loop that tells their parents (Core.ChildEnds); a full queue drops
// them, and the reaper's sweep applies them later.
func (c *Core) childEnded(id uuid.UUID) {
	select {
	case c.childEnds <- id:
	default:
	}
}

// ChildEnds are the IDs of children that finished in this process, for
// ChildEnded; the engine drains them.
func (c *Core) ChildEnds() <-chan uuid.UUID { return c.childEnds }

// applyChildEnds applies the ends of children the reaper found whose
// parents still wait for them (the process that moved them stopped
// before it told the parent), and returns how many it applied.
func (c *Core) applyChildEnds(ctx context.Context, ids []uuid.UUID) (int, error) {
	var errs []error
	applied := 0
	for _, id := range ids {
		if err := c.ChildEnded(ctx, id); err != nil {
			errs = append(errs, err)
			continue
		}
		applied++
	}
	if applied > 0 {
		c.log.Info("reaper: applied the ends of children to the parents that waited for them", "children", applied)
	}
	return applied, errors.Join(errs...)
}

// CompensateCompleted compensates saga id, which completed, as its
// parent's compensation orders: every completed step with a
// compensation is undone, in reverse (a parallel group's branches
// together), and the saga ends compensated (StateFailed if an undo
// cannot finish), as a saga that failed after its last step does.
func (c *Core) CompensateCompleted(ctx context.Context, id uuid.UUID, r Request) (Result, error) {
	fx := &effects{}
	op := repairOp{name: "compensate", r: r}
	return c.recorded(ctx, nil, id, op, func(tx *store.Tx, sg *saga.Instance) error {
		fx = &effects{}
		def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return err
		}
		if !sg.Finished() || sg.State != def.FinalState() {
			return fmt.Errorf("%w: saga %s is %q; only a completed saga is compensated whole (cancel a running one)", ErrStateForbids, id, sg.State)
		}
		undo := compensation.Completed(def, sg.Skipped)
		if def.HasGroups() {
			undo = plan.UndoCompleted(def, sg)
		}
		return c.startCompensation(ctx, tx, sg, def, undo, "compensated as its parent compensates: "+r.Reason, fx)
	}, func() { c.emit(fx) })
}
