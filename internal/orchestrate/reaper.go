package orchestrate

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/internal/plan"
	"github.com/idemsaga/idemsaga/outbox"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
)

// stepID names a step row by its primary key, (saga, step, phase).
type stepID struct {
	saga  uuid.UUID
	step  string
	phase saga.Phase
}

// ReapOnce dispatches the retries that are due and takes over the steps
// whose lease expired, at most limit of each. It returns how many steps it
// moved. Many processes may run it at once: each candidate is re-checked
// under its saga's row lock, and every write is fenced by the attempt.
func (c *Core) ReapOnce(ctx context.Context, limit int) (int, error) {
	// The looks travel in one round trip: most passes find nothing, and
	// an idle process makes one every ReapInterval.
	var due []stepID
	var late, ended []uuid.UUID
	b := &pgx.Batch{}
	names := c.VersionRefs()
	b.Queue(store.DeadlinePassed, limit, names).Query(func(rows pgx.Rows) error {
		var err error
		late, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		return err
	})
	for _, q := range []string{store.DueRetries, store.ExpiredLeases, store.ResendDue, store.ExpiredWaits} {
		b.Queue(q, limit, names).Query(func(rows pgx.Rows) error {
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
	b.Queue(store.SelectChildEnds, limit, names).Query(func(rows pgx.Rows) error {
		var err error
		ended, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		return err
	})
	if err := c.DB().SendBatch(ctx, b).Close(); err != nil {
		return 0, fmt.Errorf("find due steps: %w", store.Interpret(err))
	}
	moved := 0
	var firstErr error
	// Deadlines first, within a budget: a saga whose step is calling out
	// is left to a later pass, and leases must not wait for them.
	budget := time.Now().Add(deadlineBudget)
	for _, id := range late {
		if time.Now().After(budget) {
			break
		}
		ok, err := c.cancelLate(ctx, id)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if ok {
			moved++
		}
	}
	for _, id := range due {
		ok, err := c.reapStep(ctx, id)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if ok {
			moved++
		}
	}
	k, err := c.applyChildEnds(ctx, ended)
	if err != nil && firstErr == nil {
		firstErr = err
	}
	return moved + k, firstErr
}

func (c *Core) reapStep(ctx context.Context, id stepID) (moved bool, err error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return false, fmt.Errorf("acquire a connection: %w", err)
	}
	defer conn.Release()
	tx := store.Begin(conn.Conn(), c.schema)
	defer tx.Rollback(ctx)

	// First round trip: lock the saga (skipping one another process
	// holds) and read the step.
	var sg *saga.Instance
	var st stepRow
	var phase, status string
	var due, expired, resend, paused, waited, claimed, running, answered, ended, verifying, found bool
	var queuedMillis int64
	tx.Queue(store.LockSagaOfStep, func(row pgx.Row) error {
		var err error
		sg, err = store.ScanSaga(row)
		if errors.Is(err, saga.ErrNotFound) {
			return nil
		}
		return err
	}, pguuid.Of(id.saga))
	tx.Queue(store.SelectStepForReap, func(row pgx.Row) error {
		err := row.Scan(&st.index, &phase, &status, &st.attempt, &st.possiblyDone, &due, &expired, &resend, &paused, &waited, &claimed, &running, &answered, &ended, &queuedMillis, &verifying)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		found = err == nil
		return err
	}, pguuid.Of(id.saga), id.step, string(id.phase), store.LockID(saga.StepKey(id.saga, id.step, id.phase)))
	var traced map[string]string
	if c.tracer.Enabled() {
		tx.Queue(store.SelectTraceContext, func(row pgx.Row) error { return ignoreNoRows(row.Scan(&traced)) }, pguuid.Of(id.saga))
	}
	if err := tx.Flush(ctx); err != nil {
		return false, fmt.Errorf("lock saga %s: %w", id.saga, err)
	}
	if sg == nil || !found || paused || !due && !expired && !resend && !waited {
		return false, nil // held by another process, gone, paused, or moved on since we looked
	}
	st.phase, st.status = saga.Phase(phase), saga.StepStatus(status)
	if c.tracer.Enabled() {
		// The reaper's work continues the saga's trace from its start.
		var sp tracing.Span
		ctx, sp = c.tracer.StartRedispatch(ctx, traced, tracing.Attempt{Saga: sg.ID, Definition: sg.Definition, Step: id.step, Phase: string(st.phase), Attempt: st.attempt})
		sp.SetAttributes(tracing.AttrReason.String(reapReason(due, expired, resend, waited)))
		tx.SetTrace(c.tracer.Headers(ctx))
		defer func() { sp.End("", err) }()
	}
	def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
	if err != nil {
		return false, err
	}
	if err := c.withSteps(ctx, tx, sg, def); err != nil {
		return false, err
	}
	step := def.Step(st.index)
	policy := plan.PolicyOf(def, st.index, st.phase)
	fx := &effects{}

	switch {
	case waited:
		// A callback step's request was accepted and no callback came
		// within its wait: it may have taken effect, so it is given up
		// as possibly done.
		reason := fmt.Sprintf("no callback within %s of its request (attempt %d)", step.Wait, st.attempt)
		if step.Kind == saga.ChildStep {
			// A child's end not applied yet is applied now instead.
			if moved, err := c.applyChild(ctx, tx, sg, def, st.index, st.phase, st.attempt, fx); moved || err != nil {
				if err != nil {
					return false, err
				}
				break
			}
			reason = fmt.Sprintf("its child did not end within %s (attempt %d)", step.Wait, st.attempt)
		}
		if err := c.giveUp(ctx, tx, sg, def, st.index, st.phase, st.attempt, reason, true, fx); err != nil {
			if errors.Is(err, store.ErrBusy) {
				return false, nil
			}
			return false, err
		}
		c.metrics.CallbackWaitsExpired.WithLabelValues(def.Name(), step.Name).Inc()
	case resend:
		// A step in flight when its saga was paused: the same attempt
		// goes out again, with a fresh lease.
		if err := c.resendStep(tx, sg, def, st.index, st.phase, st.attempt, verifying); err != nil {
			return false, err
		}
	case expired && !claimed && running:
		// An attempt runs, claimed with no mark (its command came
		// promptly): its lease restarts now, the latest its claim can
		// have been, and its next expiry is a takeover.
		c.claimRunning(tx, def, id, st.index, st.attempt)
		c.metrics.CommandsRequeued.WithLabelValues(def.Name(), step.Name, string(st.phase), "claimed").Inc()
	case expired && !claimed && ended:
		// The attempt's outcome is in the inbox, and no reply applied it
		// within its lease: the reply may be lost (a worker that died
		// between its outcome's commit and its reply's, after a move
		// that missed). It is applied from the inbox, as the reply would
		// have been; a reply that comes later is a duplicate.
		reason := fmt.Sprintf("attempt %d failed for good; its outcome was recorded and its reply did not come within its lease", st.attempt)
		if err := c.giveUpOrComplete(ctx, tx, sg, def, st.index, st.phase, st.attempt, reason, st.possiblyDone, fx); err != nil {
			if errors.Is(err, store.ErrBusy) {
				return false, nil
			}
			return false, err
		}
		c.metrics.CommandsRequeued.WithLabelValues(def.Name(), step.Name, string(st.phase), "answered").Inc()
	case expired && !claimed && !(answered && st.attempt >= policy.MaxAttempts):
		// No worker claimed the command: it waits in the queue, or was
		// lost on its way. Either way the attempt has not started, and
		// costs nothing: it is kept, and sent again if lost. So is an
		// attempt the inbox answered, whose reply is on its way (the
		// last one's answer is settled below, from the inbox).
		how, err := c.requeue(ctx, tx, sg, def, st.index, st.phase, st.attempt, verifying, time.Duration(queuedMillis)*time.Millisecond)
		if err != nil {
			return false, err
		}
		c.metrics.CommandsRequeued.WithLabelValues(def.Name(), step.Name, string(st.phase), how).Inc()
		if how == "resent" {
			c.log.Info("command not claimed within its lease and not in the stream; sent again at the same attempt",
				"saga_id", sg.ID, "step", step.Name, "phase", st.phase, "attempt", st.attempt)
		}
	case due || st.attempt < policy.MaxAttempts:
		// A due retry, or a lease takeover with attempts left: the next
		// attempt goes out with the same key.
		if err := c.redispatch(tx, sg, def, st.index, st.phase, st.attempt); err != nil {
			return false, err
		}
		if expired {
			c.metrics.LeaseTakeovers.WithLabelValues(def.Name(), step.Name, string(st.phase)).Inc()
			c.log.Info("lease expired; step dispatched again", "saga_id", sg.ID, "step", step.Name, "phase", st.phase, "attempt", st.attempt+1)
		}
	case expired && !answered && st.phase == saga.PhaseForward && step.Verify != nil && st.attempt == policy.MaxAttempts:
		// The last attempt's lease expired during its call: before the
		// step is given up, one more attempt asks its Verify what the key
		// did, and calls nothing.
		if err := c.redispatchAs(tx, sg, def, st.index, st.phase, st.attempt, true); err != nil {
			return false, err
		}
		c.metrics.LeaseTakeovers.WithLabelValues(def.Name(), step.Name, string(st.phase)).Inc()
		c.log.Info("lease of the last attempt expired; its Verify is asked before the step is given up", "saga_id", sg.ID, "step", step.Name, "attempt", st.attempt+1)
	default:
		// The last attempt's lease expired with no reply: its outcome is
		// unknown. Settle it through the inbox (tombstone, then read) and
		// give it up, or apply it if it did take effect.
		reason := fmt.Sprintf("no reply after %d attempts; outcome unknown", st.attempt)
		if err := c.giveUpOrComplete(ctx, tx, sg, def, st.index, st.phase, st.attempt, reason, st.possiblyDone, fx); err != nil {
			if errors.Is(err, store.ErrBusy) {
				return false, nil // an attempt still holds the key; decide on a later pass
			}
			return false, err
		}
		c.metrics.LeaseTakeovers.WithLabelValues(def.Name(), step.Name, string(st.phase)).Inc()
	}
	if err := failpoint.Inject(failpoint.LeaseTakeover); err != nil {
		return false, err
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	fx.sent = tx.Published()
	c.emit(fx)
	return true, nil
}

// redispatch queues the next attempt of a step, fenced by the attempt seen,
// and its command, written as the saga will be after tx (its version
// bumped).
func (c *Core) redispatch(tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, seenAttempt int) error {
	return c.redispatchAs(tx, sg, def, idx, phase, seenAttempt, false)
}

// redispatchAs is redispatch; verify makes the next attempt ask the
// step's Verify alone (wire.Command.Verify).
func (c *Core) redispatchAs(tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, seenAttempt int, verify bool) error {
	after := *sg
	after.Version++
	subject, msgID, payload, err := c.plan.Command(&after, def, idx, phase, seenAttempt+1, verify)
	if err != nil {
		return err
	}
	store.QueueRedispatch(tx, store.Resend{Saga: sg.ID, Step: def.Step(idx).Name, Phase: phase, Attempt: seenAttempt, Version: sg.Version,
		LeaseMillis: c.plan.LeaseMillis(plan.PolicyOf(def, idx, phase)),
		Command:     outbox.Message{Subject: subject, MsgID: msgID, Payload: payload, Headers: tx.Trace()}, HandOff: c.handOffFor(tx), Verify: verify})
	return nil
}

// resendStep queues a step of a resumed saga sent again at its attempt, with
// a fresh lease, and its command written as the saga will be after tx
// (its version bumped). The message id carries that version: the broker
// must not drop the command as a copy of the attempt's first one.
func (c *Core) resendStep(tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, verify bool) error {
	after := *sg
	after.Version++
	subject, msgID, payload, err := c.plan.Command(&after, def, idx, phase, attemptNo, verify)
	if err != nil {
		return err
	}
	msgID += fmt.Sprintf("-v%d", after.Version)
	store.QueueResendAfterResume(tx, store.Resend{Saga: sg.ID, Step: def.Step(idx).Name, Phase: phase, Attempt: attemptNo, Version: sg.Version,
		LeaseMillis: c.plan.LeaseMillis(plan.PolicyOf(def, idx, phase)),
		Command:     outbox.Message{Subject: subject, MsgID: msgID, Payload: payload, Headers: tx.Trace()}, HandOff: c.handOffFor(tx)})
	return nil
}

// deadlineRepairKey is the request key of the cancel a saga's deadline
// makes: one per saga, so that reapers of several processes cancel it
// once (the others find the record).
const deadlineRepairKey = "idemsaga:deadline"

// deadlineBudget bounds the time one reaper pass spends on deadlines.
const deadlineBudget = time.Second

// cancelLate cancels saga id, past its deadline, as Client.Cancel does,
// recorded as a repair by "deadline". A step in flight (an external call,
// or a key an attempt holds) is waited out briefly, then left to a later
// pass. It reports whether it cancelled.
func (c *Core) cancelLate(ctx context.Context, id uuid.UUID) (bool, error) {
	var def string
	var version int
	if err := c.DB().QueryRow(ctx, `select definition, definition_version from idemsaga.sagas where id = $1`, pguuid.Of(id)).Scan(&def, &version); err != nil {
		return false, nil // gone since the look
	}
	d, err := c.DefinitionAt(ctx, def, version)
	if err != nil {
		return false, err
	}
	// withSagaLocked waits up to a second before this deadline.
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	reason := fmt.Sprintf("its deadline of %s passed", d.Deadline())
	res, err := c.cancel(cctx, id, Request{Key: deadlineRepairKey, Reason: reason, By: "deadline"}, "cancelled: "+reason)
	switch {
	case errors.Is(err, ErrStepInFlight), errors.Is(err, store.ErrBusy), errors.Is(err, context.DeadlineExceeded):
		return false, nil // a later pass
	case errors.Is(err, ErrStateForbids):
		return false, nil // it finished or compensates on its own meanwhile
	case errors.Is(err, ErrRepairKeyReused):
		c.log.Warn("saga past its deadline: its deadline's repair key was used by another request; not cancelled", "saga_id", id, "key", deadlineRepairKey)
	case err != nil:
		return false, fmt.Errorf("cancel saga %s past its deadline: %w", id, err)
	}
	// Its deadline acted: a saga an operator sets going again afterwards
	// (a retry of what the cancel parked) is not cancelled again.
	if err := store.ClearDeadline(ctx, c.DB(), id); err != nil {
		return false, fmt.Errorf("saga %s past its deadline: clear the deadline: %w", id, err)
	}
	if errors.Is(err, ErrRepairKeyReused) {
		return false, nil
	}
	if !res.Replayed {
		c.metrics.DeadlinesPassed.WithLabelValues(def).Inc()
		c.log.Info("saga past its deadline cancelled", "saga_id", id, "definition", def, "deadline", d.Deadline(), "state", res.State)
	}
	return !res.Replayed, nil
}
