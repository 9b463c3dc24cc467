package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/saga"
)

// ErrStateForbids is returned by Retry and Cancel when the saga's state
// does not allow the repair asked for.
var ErrStateForbids = errors.New("idemsaga: the saga's state does not allow this")

// Retry resumes a saga in StateFailed from where it stopped: the
// compensation that could not finish is dispatched again with the same
// step key and the next attempt, and the saga is compensating again. Use it
// after a person repaired what made the compensation fail. The step's
// earlier failure or tombstone is cleared from the inbox in the same
// transaction, so the retried attempt runs; every other step key keeps its
// record, so nothing that took effect runs twice.
func (cl *Client) Retry(ctx context.Context, id uuid.UUID) error {
	c := cl.c
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	sg, err := loadSaga(ctx, tx, id, true)
	if err != nil {
		return err
	}
	if sg.State != saga.StateFailed {
		return fmt.Errorf("%w: saga %s is %q; only a failed saga can be retried (cancel a running one instead)", ErrStateForbids, id, sg.State)
	}
	def, err := c.definition(sg.Definition)
	if err != nil {
		return err
	}
	var step string
	var idx, attempt int
	err = tx.QueryRow(ctx, `select step, step_index, attempt from idemsaga.steps
where saga_id = $1 and phase = 'compensate' and status = 'failed' order by updated_at desc limit 1`, id).Scan(&step, &idx, &attempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: saga %s failed without a failed compensation to resume; inspect it with `worker show`", ErrStateForbids, id)
	}
	if err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	key := saga.StepKey(id, step, saga.PhaseCompensate)
	if _, err := tx.Exec(ctx, `delete from idemsaga.inbox where saga_id = $1 and step_key = $2 and outcome in ('failed', 'tombstone')`, id, key); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: clear the inbox: %w", id, err)
	}
	var next int
	sid := stepID{id, step, saga.PhaseCompensate}
	if err := tx.QueryRow(ctx, retryFailedStep, sid.args(attempt, c.leaseMillis(policyOf(def, idx, saga.PhaseCompensate)))...).Scan(&next); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	t := newTxn(tx)
	// The command carries the saga as this transaction leaves it.
	resumed := *sg
	resumed.State, resumed.Version = saga.StateCompensating, sg.Version+1
	if err := c.command(t, &resumed, def, idx, saga.PhaseCompensate, next); err != nil {
		return err
	}
	if err := t.flush(ctx); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	tag, err := tx.Exec(ctx, `update idemsaga.sagas set state = 'compensating', finished_at = null, version = version + 1, updated_at = now()
where id = $1 and state = 'failed' and version = $2`, id, sg.Version)
	if err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return classifyMiss(ctx, tx, id, saga.StateCompensating)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: commit: %w", id, err)
	}
	c.sent(t.sent)
	return nil
}

// Cancel stops a running saga and compensates what it completed. The step
// in flight is settled through the inbox first (a tombstone under its key,
// then what the inbox holds): if it already took effect it counts as
// completed and is compensated too; if not, no late delivery can make it
// take effect. A saga already compensating or finished is refused.
func (cl *Client) Cancel(ctx context.Context, id uuid.UUID, reason string) error {
	c := cl.c
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: cancel saga %s: %w", id, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	sg, err := loadSaga(ctx, tx, id, true)
	if err != nil {
		return err
	}
	if sg.Finished() || sg.State == saga.StateCompensating {
		return fmt.Errorf("%w: saga %s is %q; only a running saga that is not compensating can be cancelled", ErrStateForbids, id, sg.State)
	}
	def, err := c.definition(sg.Definition)
	if err != nil {
		return err
	}
	var step string
	var idx, attempt int
	err = tx.QueryRow(ctx, `select step, step_index, attempt from idemsaga.steps
where saga_id = $1 and phase = 'forward' and status in ('dispatched', 'retrying') for update`, id).Scan(&step, &idx, &attempt)
	if err != nil {
		return fmt.Errorf("idemsaga: cancel saga %s: find the step in flight: %w", id, err)
	}
	t := newTxn(tx)
	outcome, result, err := c.settle(ctx, t, sg, def, idx, saga.PhaseForward)
	if err != nil {
		return err
	}
	fx := &effects{}
	sid := stepID{id, step, saga.PhaseForward}
	completed := idx
	if outcome == "succeeded" {
		if idx == def.Len()-1 {
			// It completed the saga: apply that; there is nothing to cancel.
			if err := c.succeed(t, sg, def, idx, saga.PhaseForward, attempt, result, fx); err != nil {
				return err
			}
			if err := t.commit(ctx); err != nil {
				return err
			}
			fx.sent = t.sent
			c.emit(fx)
			return fmt.Errorf("%w: saga %s completed before it could be cancelled", ErrStateForbids, id)
		}
		c.finishStep(t, sid, attempt, saga.StepSucceeded, result, "")
		st := def.Step(idx)
		if err := c.transition(t, sg, st.Reaches, false, nil, &st.Name, result, fx); err != nil {
			return err
		}
		completed = idx + 1
	} else {
		c.finishStep(t, sid, attempt, saga.StepFailed, nil, "cancelled")
	}
	msg := "cancelled by an operator"
	if reason != "" {
		msg += ": " + reason
	}
	if err := c.transition(t, sg, saga.StateCompensating, false, &msg, nil, nil, fx); err != nil {
		return err
	}
	plan := compensation.Plan(def, completed)
	if len(plan) == 0 {
		err = c.transition(t, sg, saga.StateCompensated, true, nil, nil, nil, fx)
	} else {
		err = c.dispatch(t, sg, def, plan[0], saga.PhaseCompensate)
	}
	if err != nil {
		return err
	}
	if err := t.commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: cancel saga %s: commit: %w", id, err)
	}
	fx.sent = t.sent
	c.emit(fx)
	return nil
}
