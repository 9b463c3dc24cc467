package attempt

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/limit"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// An attempt in hand keeps its lease alive in two cases: while it waits
// for its turn under a limit (before its claim: it has not started), and
// when its handler calls StepContext.Heartbeat during a long call. Either
// also tells the broker the command is in progress, so it is not
// delivered again after AckWait.

// keepEveryMax bounds the time between two pushes of a waiting attempt's
// lease: well inside the broker's AckWait (a minute at least).
const keepEveryMax = 10 * time.Second

// progressKey carries, in the context of a delivered command, what tells
// the broker its command is still in hand (jetstream.Msg.InProgress).
type progressKey struct{}

func withProgress(ctx context.Context, fn func()) context.Context {
	return context.WithValue(ctx, progressKey{}, fn)
}

func progressOf(ctx context.Context) func() {
	if fn, ok := ctx.Value(progressKey{}).(func()); ok {
		return fn
	}
	return func() {}
}

// lease is how long an attempt's lease and its holds last from a push.
func (r *Runner) lease(policy saga.RetryPolicy) time.Duration {
	return policy.Timeout + r.cfg.LeaseGrace
}

// takeTurn waits for the attempt's turn under its step's limit (a.turn),
// pushing the step's lease meanwhile. done is set when the attempt ends
// here: a delivered-again command whose outcome the inbox holds is
// answered with it, and an attempt that lost its step while it waited
// (taken over, given up) is dropped.
func (a *attempt) takeTurn(ctx context.Context) (reply wire.Reply, done bool, err error) {
	cmd := a.cmd
	if a.plan.ReadFirst {
		var st stored
		var found bool
		err := a.r.cfg.Pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
			var err error
			if st, found, err = readStoredOn(ctx, c.Conn(), a.r.cfg.Schema, cmd.SagaID, cmd.Key); err != nil || !found || !st.final() {
				return err
			}
			reply, err = a.answerStored(ctx, c.Conn(), st, false)
			return err
		})
		if err != nil || found && st.final() {
			return reply, true, err
		}
		a.plan.ReadFirst = false // read: the claim need not read again
	}
	if a.row != 0 && !a.consumed && !a.queued {
		// Run eagerly, its command row goes now: the relay must not send
		// it while it waits. Should the process die, the lease drives it.
		if _, err := a.r.db().Exec(ctx, store.DeleteCommand, a.row); err != nil {
			return a.replyBase(), true, fmt.Errorf("consume the command before waiting for limit %s: %w", a.step.Limit.Name, err)
		}
		a.consumed = true
	}
	l := a.step.Limit
	lease := a.r.lease(a.policy)
	a.turn, err = a.r.gate.Wait(ctx, l, limit.Attempt{Key: a.limitKey(), Hold: lease,
		Every: min(max(lease/3, 50*time.Millisecond), keepEveryMax), Keep: a.keepWaiting})
	switch {
	case errors.Is(err, saga.ErrLeaseLost):
		a.dropped = true
		reply = a.replyBase()
		reply.Outcome, reply.Duplicate = wire.OutcomeRetry, true
		reply.Error = fmt.Sprintf("attempt %d lost its step while it waited for limit %s", cmd.Attempt, l.Name)
		a.r.cfg.Logger.Info("step worker: an attempt lost its step while it waited for its limit; dropped", "saga_id", cmd.SagaID, "step", cmd.Step,
			"phase", cmd.Phase, "attempt", cmd.Attempt, "limit", l.Name)
		return reply, true, nil
	case err != nil:
		return a.replyBase(), true, fmt.Errorf("wait for limit %s: %w", l.Name, err)
	}
	return wire.Reply{}, false, nil
}

// limitKey is the call's key for its limit's per-key bound.
func (a *attempt) limitKey() (key string) {
	fn := a.step.Limit.KeyFunc
	if fn == nil {
		return ""
	}
	defer func() {
		if p := recover(); p != nil {
			a.r.cfg.Logger.Error("step worker: a limit's KeyFunc panicked; the call counts against no per-key bound", "limit", a.step.Limit.Name,
				"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "panic", p)
			key = ""
		}
	}()
	sc, err := a.context(nil, nil)
	if err != nil {
		a.r.cfg.Logger.Error("step worker: a limit's KeyFunc cannot read the saga's input; the call counts against no per-key bound", "limit", a.step.Limit.Name,
			"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "error", err)
		return ""
	}
	return fn(sc)
}

// keepWaiting pushes the lease of an attempt that waits for its turn,
// without marking it claimed: it has not started. An error wrapping
// saga.ErrLeaseLost says the attempt is no longer the step's; a database
// out of reach is not an error here (the lease runs as it was).
func (a *attempt) keepWaiting(ctx context.Context) error {
	c := a.cmd
	var one int
	err := a.r.db().QueryRow(ctx, store.ExtendLease, pguuid.Of(c.SagaID), c.Step, string(c.Phase), c.Attempt, a.r.lease(a.policy).Milliseconds()).Scan(&one)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: step %q (%s) of saga %s is no longer at attempt %d", saga.ErrLeaseLost, c.Step, c.Phase, c.SagaID, c.Attempt)
	case err != nil:
		a.r.cfg.Logger.Debug("step worker: could not push the lease of an attempt waiting for its limit", "saga_id", c.SagaID, "step", c.Step, "error", err)
		return nil
	}
	a.progress()
	a.r.cfg.Metrics.LeaseExtensions.WithLabelValues(c.Definition, c.Step, "limit").Inc()
	return nil
}

// lengthen restarts a claimed attempt's lease and its holds from now. An
// error wrapping saga.ErrLeaseLost says the attempt is no longer the
// step's; a hold it cannot push lapses with the lease it had, and is only
// logged.
func (a *attempt) lengthen(ctx context.Context) error {
	c := a.cmd
	var one int
	err := a.r.db().QueryRow(ctx, store.ClaimLease, pguuid.Of(c.SagaID), c.Step, string(c.Phase), c.Attempt, a.r.lease(a.policy).Milliseconds()).Scan(&one)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: step %q (%s) of saga %s is no longer at attempt %d", saga.ErrLeaseLost, c.Step, c.Phase, c.SagaID, c.Attempt)
	case err != nil:
		return fmt.Errorf("idemsaga: push the lease of step %q of saga %s: %w (the lease runs as it was; try again)", c.Step, c.SagaID, store.Interpret(err))
	}
	if err := a.turn.Extend(ctx); err != nil {
		a.r.cfg.Logger.Warn("step worker: could not push the holds of a call under its limit; they lapse with the lease they had", "saga_id", c.SagaID,
			"step", c.Step, "limit", a.step.Limit.Name, "error", err)
	}
	a.progress()
	return nil
}

// push is lengthen where the runner itself pushes (before Verify, before
// a call that waited): a failure leaves the attempt to its fence.
func (a *attempt) push(ctx context.Context) {
	if err := a.lengthen(ctx); err != nil {
		a.r.cfg.Logger.Debug("step worker: could not push an attempt's lease", "saga_id", a.cmd.SagaID, "step", a.cmd.Step, "error", err)
	}
}

// beat is an external attempt's saga.Lease: its handler's heartbeat.
type beat struct{ a *attempt }

// Extend restarts the attempt's lease, its holds and its time from now.
func (b beat) Extend(ctx context.Context) error {
	a, c := b.a, b.a.cmd
	if err := a.lengthen(ctx); err != nil {
		return err
	}
	if s := a.stretch.Load(); s != nil {
		s.extend(a.policy.Timeout)
	}
	a.r.cfg.Metrics.LeaseExtensions.WithLabelValues(c.Definition, c.Step, "heartbeat").Inc()
	return nil
}
