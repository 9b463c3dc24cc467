package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/saga"
)

// ReapOnce dispatches the retries that are due and takes over the steps
// whose lease expired, at most limit of each. It returns how many steps it
// moved. Many processes may run it at once: each candidate is re-checked
// under its saga's row lock, and every write is fenced by the attempt.
func (c *core) ReapOnce(ctx context.Context, limit int) (int, error) {
	// Both looks travel in one round trip: most passes find nothing, and
	// an idle process makes one every ReapInterval.
	var due []stepID
	b := &pgx.Batch{}
	for _, q := range []string{dueRetries, expiredLeases} {
		b.Queue(q, limit).Query(func(rows pgx.Rows) error {
			ids, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (stepID, error) {
				var id stepID
				var phase string
				err := row.Scan(&id.saga, &id.step, &phase)
				id.phase = saga.Phase(phase)
				return id, err
			})
			due = append(due, ids...)
			return err
		})
	}
	if err := c.pool.SendBatch(ctx, b).Close(); err != nil {
		return 0, fmt.Errorf("find due steps: %w", err)
	}
	moved := 0
	var firstErr error
	for _, id := range due {
		ok, err := c.reapStep(ctx, id)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if ok {
			moved++
		}
	}
	return moved, firstErr
}

func (c *core) reapStep(ctx context.Context, id stepID) (bool, error) {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit

	var sagaID uuid.UUID
	err = tx.QueryRow(ctx, lockSagaOfStep, pguuid.Of(id.saga)).Scan(&sagaID)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil // another process holds the saga, or it is gone
	}
	if err != nil {
		return false, fmt.Errorf("lock saga %s: %w", id.saga, err)
	}
	var st stepRow
	var phase, status string
	var due, expired bool
	err = tx.QueryRow(ctx, selectStepForReap, id.args()...).Scan(&st.index, &phase, &status, &st.attempt, &due, &expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil // gone since we looked
	}
	if err != nil {
		return false, fmt.Errorf("read step %q (%s) of saga %s: %w", id.step, id.phase, id.saga, err)
	}
	st.phase, st.status = saga.Phase(phase), saga.StepStatus(status)
	if !due && !expired {
		return false, nil // moved on since we looked
	}
	sg, err := loadSaga(ctx, tx, sagaID, false)
	if err != nil {
		return false, err
	}
	def, err := c.definition(sg.Definition)
	if err != nil {
		return false, err
	}
	step := def.Step(st.index)
	policy := policyOf(def, st.index, st.phase)
	fx := &effects{}
	t := newTxn(tx)

	switch {
	case due || st.attempt < policy.MaxAttempts:
		// A due retry, or a lease takeover with attempts left: the next
		// attempt goes out with the same key.
		ok, err := c.redispatch(ctx, t, sg, def, st.index, st.phase, st.attempt)
		if err != nil || !ok {
			return false, err
		}
		if expired {
			c.metrics.LeaseTakeovers.WithLabelValues(def.Name(), step.Name, string(st.phase)).Inc()
			c.log.Info("lease expired; step dispatched again", "saga_id", sg.ID, "step", step.Name, "phase", st.phase, "attempt", st.attempt+1)
		}
	default:
		// The last attempt's lease expired with no reply: the outcome is
		// unknown. Settle it through the inbox (tombstone, then read) and
		// give it up, or apply it if it did take effect.
		reason := fmt.Sprintf("no reply after %d attempts; outcome unknown", st.attempt)
		if err := c.abandon(ctx, t, sg, def, st.index, st.phase, st.attempt, reason, fx); err != nil {
			if isLockTimeout(err) {
				return false, nil // a worker still holds the key; decide on a later pass
			}
			return false, err
		}
		c.metrics.LeaseTakeovers.WithLabelValues(def.Name(), step.Name, string(st.phase)).Inc()
	}
	if err := failpoint.Inject(failpoint.LeaseTakeover); err != nil {
		return false, err
	}
	if err := t.commit(ctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	fx.sent = t.sent
	c.emit(fx)
	return true, nil
}

// isLockTimeout reports a lock_timeout expiry (SQLSTATE 55P03).
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}
