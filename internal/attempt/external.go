package attempt

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// external runs one attempt of an external step in three parts: its
// claim, a transaction of its own committed before the call (and, for a
// compensation, the forward key's fence and outcome); the call, holding
// no transaction and no connection; its outcome, a second short
// transaction fenced by the attempt, applied to the saga or replied. An
// attempt whose claim finds the same attempt claimed already does not call
// again: one call per attempt, at most. A step under a limit takes its
// turn before the claim (limit.Gate), and a claim that finds an earlier
// attempt's outcome unknown asks the step's Verify before it calls.
func (a *attempt) external(ctx context.Context) (wire.Reply, error) {
	cmd := a.cmd
	if !a.step.Limit.IsZero() {
		reply, done, err := a.takeTurn(ctx)
		if done || err != nil {
			return reply, err
		}
		defer a.turn.Release(context.WithoutCancel(ctx))
	}
	// The claim and the reads before the call are bounded as the call
	// is; the call gets its own time once they are done.
	actx, cancel := context.WithTimeout(ctx, a.policy.Timeout)
	defer cancel()

	var claimed bool
	var st, fwd stored
	var found, byRead bool
	err := a.r.cfg.Pool.AcquireFunc(actx, func(conn *pgxpool.Conn) error {
		c := conn.Conn()
		if a.plan.ReadFirst {
			var err error
			if st, found, err = readStoredOn(actx, c, a.r.cfg.Schema, cmd.SagaID, cmd.Key); err != nil || found && st.final() {
				byRead = err == nil
				return err
			}
		}
		tx := store.Implicit(c, a.r.cfg.Schema)
		sagaID, key := pguuid.Of(cmd.SagaID), pguuid.Of(cmd.Key)
		tx.Queue(store.ClaimCall, func(row pgx.Row) error {
			err := row.Scan(&a.doubt)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			claimed = err == nil
			return err
		}, sagaID, key, cmd.Step, string(cmd.Phase), cmd.Attempt, store.LockID(cmd.Key))
		tx.Queue(store.ReadStored, st.scan(&found), sagaID, key)
		if cmd.Phase == saga.PhaseCompensate {
			fwdKey := pguuid.Of(saga.StepKey(cmd.SagaID, cmd.Step, saga.PhaseForward))
			tx.Exec(store.FenceForward, nil, sagaID, fwdKey, cmd.Step)
			tx.Queue(store.ReadStored, fwd.scan(nil), sagaID, fwdKey)
		}
		// Run eagerly, the command is consumed by its claim: should the
		// process die during the call, the lease drives it again.
		a.consume(tx)
		if err := tx.Commit(actx); err != nil {
			return fmt.Errorf("claim the call: %w", err)
		}
		a.committed(tx, nil, nil)
		return nil
	})
	if err != nil {
		return a.replyBase(), err
	}
	if !claimed && !(found && st.final()) {
		// Not claimed, and no outcome to answer with: maybe the saga is
		// paused (a rare path, so a round trip of its own).
		var paused bool
		if err := a.r.db().QueryRow(actx, store.PausedRead, pguuid.Of(cmd.SagaID)).Scan(&paused); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return a.replyBase(), fmt.Errorf("read whether the saga is paused: %w", err)
		}
		if paused {
			return a.held()
		}
	}
	switch {
	case found && st.final():
		a.conflict = !byRead
		var reply wire.Reply
		err := a.r.cfg.Pool.AcquireFunc(actx, func(c *pgxpool.Conn) error {
			var err error
			reply, err = a.answerStored(actx, c.Conn(), st, false)
			return err
		})
		return reply, err
	case !claimed && !found:
		return a.sagaGone()
	case !claimed:
		// This attempt is calling in another delivery, or a later attempt
		// took over: this one does not call.
		a.dropped, a.conflict = true, true
		reply := a.replyBase()
		reply.Outcome, reply.Duplicate = wire.OutcomeRetry, true
		reply.Error = fmt.Sprintf("attempt %d is %s at attempt %d in another delivery", cmd.Attempt, st.outcome, st.attempt)
		return reply, nil
	}
	if err := failpoint.Inject(failpoint.StepAfterInbox); err != nil {
		return a.replyBase(), err
	}

	verifies := cmd.Phase == saga.PhaseForward && a.step.Verify != nil
	switch {
	case cmd.Verify && !verifies:
		// Sent for a Verify the step no longer has (a build without it):
		// the outcome stays unknown, and the give-up rule decides.
		return a.recordCall(ctx, nil, fmt.Errorf("attempt %d's outcome is unknown, and step %q has no Verify to ask", cmd.Attempt-1, cmd.Step), "")
	case cmd.Verify:
		// The reaper's last word on a step whose last attempt's outcome
		// is unknown: ask, never call.
		result, note, herr := a.verify(ctx, fmt.Errorf("attempt %d's outcome is unknown (its worker stopped before recording it)", cmd.Attempt-1))
		return a.recordCall(ctx, result, herr, note)
	case a.doubt && verifies && a.step.Kind == saga.ExternalStep:
		// An earlier attempt's outcome is unknown (its worker stopped,
		// or its Verify could not tell): ask before calling again. A
		// callback step sends its request again instead: the request
		// under its key is what makes the other system call back again,
		// should its callbacks have been lost.
		result, note, herr := a.verify(ctx, fmt.Errorf("an earlier attempt's outcome is unknown"))
		if herr == nil {
			return a.recordCall(ctx, result, nil, note)
		}
	}

	var fwdp *stored
	if cmd.Phase == saga.PhaseCompensate {
		fwdp = &fwd
	}
	paced, err := a.turn.Pace(ctx)
	if err != nil {
		// Claimed, and nothing called: known not to have taken effect
		// (the process stops, or the database is out of reach).
		return a.recordCall(ctx, nil, saga.NotApplied(fmt.Errorf("waiting for the start of the call under limit %s: %w", a.step.Limit.Name, err)), "")
	}
	if a.verified || paced {
		// A Verify or a wait for the rate ran since the claim: the call
		// starts with its lease whole.
		a.push(ctx)
	}
	callCtx, cancelCall := withStretch(ctx, a.policy.Timeout)
	defer cancelCall()
	a.stretch.Store(callCtx)
	result, herr := a.runHandler(callCtx, nil, fwdp)
	if err := failpoint.Inject(failpoint.StepAfterCall); err != nil {
		return a.replyBase(), err // as a crash after the call: the outcome stays unknown
	}
	if a.r.faults.take(LoseOutcome, cmd) {
		return a.replyBase(), ErrCrashed
	}
	note := ""
	if unknown(herr) && verifies {
		result, note, herr = a.verify(ctx, herr)
	}
	return a.recordCall(ctx, result, herr, note)
}

// unknown reports an outcome the engine cannot read as done or not done.
func unknown(herr error) bool {
	return herr != nil && !saga.IsPermanent(herr) && !saga.IsNotApplied(herr)
}

// verify asks the step's Verify what its key did after a call whose
// outcome is unknown, with time of its own (the call may have used all
// the attempt's): done gives the step's result, not done makes the
// attempt NotApplied, anything else leaves it unknown. note is what the
// attempt's record says of a success Verify found.
func (a *attempt) verify(ctx context.Context, herr error) (result []byte, note string, err error) {
	if _, err := a.turn.Pace(ctx); err != nil {
		return nil, "", fmt.Errorf("%w; Verify did not run: %w", herr, err)
	}
	// Verify runs with its lease whole and time of its own: the call
	// before it may have used all of both.
	a.push(ctx)
	a.verified = true
	vctx, cancel := withStretch(context.WithoutCancel(ctx), a.policy.Timeout)
	defer cancel()
	a.stretch.Store(vctx)
	vsc, verr := a.context(nil, nil)
	var got json.RawMessage
	if verr == nil {
		got, verr = invoke(vctx, a.step.Verify, vsc)
	}
	answer := "unknown"
	switch {
	case verr == nil:
		answer = "done"
		note = fmt.Sprintf("the outcome was unknown (%v); Verify found the key took effect", herr)
		result, err = got, nil
	case saga.IsNotApplied(verr):
		answer = "not_done"
		a.verifiedNotDone = true
		err = saga.NotApplied(fmt.Errorf("%w; Verify found the key did not take effect: %w", herr, verr))
	default:
		err = fmt.Errorf("%w; Verify could not tell: %w", herr, verr)
	}
	a.r.cfg.Metrics.Verified.WithLabelValues(a.cmd.Definition, a.cmd.Step, answer).Inc()
	a.r.cfg.Logger.Info("step worker: verified an unknown outcome", "saga_id", a.cmd.SagaID, "step", a.cmd.Step, "attempt", a.cmd.Attempt, "key", a.cmd.Key, "answer", answer)
	return result, note, err
}

// recordCall records an external attempt's outcome in a short transaction
// of its own, fenced by the attempt: a success, in the step when the plan
// allows; a failure for good or NotApplied, as known; any other error as
// unknown. An attempt given up or taken over meanwhile records nothing.
func (a *attempt) recordCall(ctx context.Context, result []byte, herr error, note string) (wire.Reply, error) {
	reply := a.replyBase()
	if herr == nil && a.step.Kind != saga.ChildStep {
		// (A child step's answer is the engine's, about its child.)
		var err error
		if result, err = a.r.cfg.Sealer.Seal(a.cmd.SagaID, result); err != nil {
			return reply, err
		}
	}
	w := store.Record{Lead: store.LeadExternal, Saga: a.cmd.SagaID, Key: a.cmd.Key, Step: a.cmd.Step, Phase: a.cmd.Phase, Attempt: a.cmd.Attempt, HandOff: a.handOff()}
	var m *store.Move
	switch {
	case herr == nil && a.step.Kind == saga.CallbackStep && a.cmd.Phase == saga.PhaseForward:
		// The request was accepted: the step waits for its callback, which
		// decides. The orchestrator makes the step wait, and applies a
		// callback that came first.
		reply.Outcome, reply.Result = wire.OutcomeWaiting, result
		w.InboxOutcome, w.Result = "waiting", result
	case herr == nil && a.step.Kind == saga.ChildStep && (a.cmd.Phase == saga.PhaseForward || len(result) > 0):
		// The child started, or was ordered to compensate: the step
		// waits for its end, which decides (a compensation that found no
		// child succeeds at once, below).
		reply.Outcome, reply.Result = wire.OutcomeWaiting, result
		w.InboxOutcome, w.Result = "waiting", result
	case herr == nil:
		reply.Outcome, reply.Result = wire.OutcomeSucceeded, result
		w.InboxOutcome, w.Result = "succeeded", result
		m = a.move(Outcome{Status: wire.OutcomeSucceeded, Result: result})
		w.Move = m
	case saga.IsPermanent(herr):
		reply.Outcome, reply.Error = wire.OutcomeFailed, herr.Error()
		w.InboxOutcome, w.ErrText = "failed", reply.Error
	case saga.IsNotApplied(herr):
		reply.Outcome, reply.Error = wire.OutcomeRetry, herr.Error()
		w.InboxOutcome, w.ErrText = "retry", reply.Error
	default:
		reply.Outcome, reply.Error = wire.OutcomeUnknown, herr.Error()
		w.InboxOutcome, w.ErrText, w.Unknown = "retry", reply.Error, true
		a.unknown = true
	}
	// A Verify's "not done" closes the doubt of the attempts before it,
	// unless this attempt's own outcome is unknown again.
	w.Verified = a.verifiedNotDone && !w.Unknown
	w.Resolved = w.Verified || note != "" // note: Verify found it done
	if d, ok := saga.RetryDelay(herr); ok {
		reply.RetryAfterMillis = d.Milliseconds()
	}
	w.Proof = w.InboxOutcome
	msg, err := a.replyMessage(reply)
	if err != nil {
		return reply, err
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	var out store.Recorded
	err = a.r.cfg.Pool.AcquireFunc(rctx, func(c *pgxpool.Conn) error {
		tx := store.Implicit(c.Conn(), a.r.cfg.Schema)
		if note != "" {
			// What Verify found commits with the outcome it decided, so
			// whoever reads the finished saga reads it too. An attempt
			// taken over or given up meanwhile is noted nowhere.
			tx.Exec(store.NoteVerifiedAttempt, nil, pguuid.Of(a.cmd.SagaID), a.cmd.Step, string(a.cmd.Phase), a.cmd.Attempt, note)
		}
		var err error
		out, err = a.commitWrite(rctx, tx, w, msg)
		return err
	})
	if err != nil {
		return reply, fmt.Errorf("record the outcome of the call (%s): %w", describe(reply), err)
	}
	if !out.Led {
		// Given up (a tombstone) or taken over by a later attempt: the
		// engine already treats this attempt's outcome as unknown.
		a.dropped = true
		a.r.cfg.Logger.Warn("step worker: the call's outcome came after its attempt was given up or taken over; not recorded (the step counts as possibly done: its compensation runs under the forward key, which the other system must treat as void)",
			"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "phase", a.cmd.Phase, "attempt", a.cmd.Attempt, "outcome", reply.Outcome, "key", a.cmd.Key)
		reply.Duplicate = true
		return reply, nil
	}
	a.stored = reply.Outcome == wire.OutcomeSucceeded || reply.Outcome == wire.OutcomeFailed
	a.afterMove(m, &out)
	return reply, nil
}

func describe(r wire.Reply) string {
	if r.Error != "" {
		return string(r.Outcome) + ": " + r.Error
	}
	return string(r.Outcome)
}
