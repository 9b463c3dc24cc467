package attempt

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// errHandlerEndedTx is the error of a handler that ended its step's
// transaction itself.
var errHandlerEndedTx = errors.New("the handler ended the step's transaction itself (COMMIT, ROLLBACK or PREPARE TRANSACTION through sc.Tx), so its success cannot be recorded with its effect; do not end the step's transaction: return nil to commit it, an error to roll it back")

// recordTimeout bounds the transaction that records a failure, which runs
// after the attempt's own deadline may have passed.
const recordTimeout = 10 * time.Second

// database runs one attempt of a database step: BEGIN with the claim (and,
// for a compensation, the forward key's fence and outcome) in the first
// round trip; the handler's statements; the outcome, applied to the saga
// or replied, with COMMIT in the last. A failure rolls the attempt back
// and is recorded in a transaction of its own, in the same round trip as
// the ROLLBACK.
func (a *attempt) database(ctx context.Context) (wire.Reply, error) {
	cmd := a.cmd
	actx, cancel := context.WithTimeout(ctx, a.policy.Timeout)
	defer cancel()
	var tx *store.Tx
	var cl *claim
	if p := a.given; p != nil && p.conn != nil && p.key == cmd.Key && p.attempt == cmd.Attempt {
		// Claimed in the round trip of the move that dispatched it.
		a.conn, tx, cl, a.first = p.conn, p.tx, p.claim, p.first
		p.conn = nil
	} else {
		conn, err := a.r.cfg.Pool.Acquire(actx)
		if err != nil {
			return a.replyBase(), fmt.Errorf("acquire a connection: %w", err)
		}
		a.conn = conn
		tx = store.Begin(conn.Conn(), a.r.cfg.Schema)
	}
	c := a.conn.Conn()
	// A connection still inside a transaction when released (an error
	// midway that a rollback could not clear) is closed by the pool. The
	// attempt may hand its connection on (a.conn nil), to the claim of
	// the step its move dispatched, or to the failure's record.
	defer func() {
		if a.conn != nil {
			tx.Rollback(ctx)
			a.conn.Release()
			a.conn = nil
		}
	}()

	if cl == nil {
		if a.plan.ReadFirst {
			// A database step's inbox row is there only once an attempt
			// committed: a final outcome answers, and so does the end of
			// this attempt or a later one. Anything else, and the claim
			// decides, as for any delivery.
			st, found, err := readStoredOn(actx, c, a.r.cfg.Schema, cmd.SagaID, cmd.Key)
			if err != nil {
				return a.replyBase(), err
			}
			if found {
				if err := a.checkKind(st); err != nil {
					return a.replyBase(), err
				}
				if st.final() {
					return a.answerStored(actx, c, st, false)
				}
				if st.endedAt(cmd.Attempt) {
					return a.ended(st)
				}
			}
		}
		// The command's own row goes before the claim's savepoint: a
		// failure rolled back to it keeps the row consumed.
		a.consume(tx)
		cl = queueClaim(tx, cmd.SagaID, cmd.Key, cmd.Step, cmd.Phase, cmd.Attempt, a.policy)
		if err := tx.Flush(actx); err != nil {
			return a.replyBase(), err
		}
	}
	fwd := cl.fwd
	if !cl.taken {
		// The key is held (or the saga is gone): nothing of this attempt
		// was store.Recorded. The ROLLBACK and a read of what the inbox holds go
		// in one round trip; what it holds answers the delivery.
		a.conflict = true
		var st stored
		var found bool
		end := store.Implicit(c, a.r.cfg.Schema)
		end.Exec("rollback", nil)
		a.unconsume()
		a.consume(end)
		end.Queue(store.ReadStored, st.scan(&found), pguuid.Of(cmd.SagaID), pguuid.Of(cmd.Key))
		var paused bool
		end.Queue(store.PausedRead, scanPaused(&paused), pguuid.Of(cmd.SagaID))
		if err := end.Commit(actx); err != nil {
			return a.replyBase(), fmt.Errorf("read what the inbox holds for a key already claimed: %w", err)
		}
		a.committed(end, nil, nil)
		if err := a.checkKind(st); err != nil {
			return a.replyBase(), err
		}
		switch {
		case found && st.final():
			return a.answerStored(actx, c, st, false)
		case found && st.endedAt(cmd.Attempt):
			return a.ended(st)
		case paused:
			return a.held()
		case !found:
			return a.sagaGone()
		}
		// An earlier attempt's end that this claim did not take: the key
		// moved between the claim and the read.
		return a.replyBase(), fmt.Errorf("the key of step %q held attempt %d's end (%s), which attempt %d could not claim; it is delivered again", cmd.Step, st.attempt, st.outcome, cmd.Attempt)
	}
	if err := failpoint.Inject(failpoint.StepAfterInbox); err != nil {
		return a.replyBase(), err
	}

	htx := &handlerTx{conn: c}
	result, herr := a.runHandler(actx, htx, fwd)
	htx.close()
	if herr == nil && c.PgConn().TxStatus() == 'I' {
		// The handler ended the transaction: its writes may have committed
		// on their own, without the outcome. It fails for good; after a
		// COMMIT, the failure's record finds the claim's row and the
		// success it stands for answers instead.
		herr = saga.Permanent(fmt.Errorf("step %q of %q: %w", cmd.Step, cmd.Definition, errHandlerEndedTx))
	}
	if herr == nil {
		return a.commitSuccess(actx, tx, result)
	}
	// The handler failed: nothing it wrote survives, and the claim's
	// transaction records why.
	return a.recordFailure(ctx, tx, herr)
}

// runHandler runs the handler, or, for a compensation whose forward step
// took no effect, nothing.
func (a *attempt) runHandler(ctx context.Context, tx saga.Tx, fwd *stored) ([]byte, error) {
	if fwd != nil && !fwd.undo() && a.step.Kind != saga.ChildStep {
		// (A child step asks its child: Children.Undo.)
		return nil, nil // the forward step took no effect and now never will
	}
	if a.handler == nil {
		return nil, saga.Permanent(fmt.Errorf("step %q may have taken effect and has no compensation; undo its effect by hand", a.cmd.Step))
	}
	sc, err := a.context(tx, fwd)
	if err != nil {
		return nil, err // the keyring lacks a key: tried again, once it has it
	}
	result, err := invoke(ctx, a.handler, sc)
	if max := a.r.cfg.MaxResultBytes; err == nil && max > 0 && len(result) > max {
		err = fmt.Errorf("%w: the result of step %q (%s) is %d bytes, over the %d-byte bound (Config.MaxResultBytes); return less: keep large data in your own table and return its id",
			saga.ErrResultTooLarge, a.cmd.Step, a.cmd.Phase, len(result), max)
		if a.step.Kind == saga.DatabaseStep {
			// Its writes are rolled back with the attempt: no effect.
			err = saga.Permanent(err)
		}
		// Another step's call may have taken effect: its outcome is
		// unknown, tried again under its key.
	}
	return result, err
}

// commitSuccess records a success with COMMIT: applied to the saga in the
// step when the plan allows and the saga is where the command says (the
// result then in the step's row), otherwise with a reply (the result in
// the inbox row).
func (a *attempt) commitSuccess(ctx context.Context, tx *store.Tx, result []byte) (wire.Reply, error) {
	reply := a.replyBase()
	result, err := a.r.cfg.Sealer.Seal(a.cmd.SagaID, result)
	if err != nil {
		return reply, err
	}
	reply.Outcome, reply.Result = wire.OutcomeSucceeded, result
	w := store.Record{Lead: store.LeadNone, Saga: a.cmd.SagaID, Key: a.cmd.Key, Step: a.cmd.Step, Phase: a.cmd.Phase, Attempt: a.cmd.Attempt,
		Result: result, HandOff: a.handOff(), Proof: "succeeded"}
	m := a.move(Outcome{Status: wire.OutcomeSucceeded, Result: result})
	w.Move = m
	msg, err := a.replyMessage(reply)
	if err != nil {
		return reply, err
	}
	out, err := a.commitWrite(ctx, tx, w, msg)
	if err != nil {
		return reply, fmt.Errorf("record the success: %w", err)
	}
	a.stored = true
	a.afterMove(m, &out)
	return reply, nil
}

// recordFailure records a failed handler's outcome under a fresh context
// (the attempt's may have expired, and the outcome must still be
// recorded): in the claim's transaction tx, rolled back to the claim's
// savepoint, so that the key goes from claimed to its failure without
// ever looking free; or, when that transaction is gone (its connection
// broke, the handler ended it), in a transaction of its own. A failure for
// good, or a last attempt's, is stored under the key as failed and goes
// onto the saga when the plan allows; a retry is stored as the attempt's
// end (retry), which a later delivery of the same attempt finds, and
// answered with a reply.
func (a *attempt) recordFailure(ctx context.Context, tx *store.Tx, herr error) (wire.Reply, error) {
	reply := a.replyBase()
	reply.Error = herr.Error()
	if d, ok := saga.RetryDelay(herr); ok {
		reply.RetryAfterMillis = d.Milliseconds()
	}
	o := Outcome{Status: wire.OutcomeRetry, Error: reply.Error}
	if saga.IsPermanent(herr) {
		o.Status = wire.OutcomeFailed
	}
	w := store.Record{Saga: a.cmd.SagaID, Key: a.cmd.Key, Step: a.cmd.Step, Phase: a.cmd.Phase, Attempt: a.cmd.Attempt, HandOff: a.handOff()}
	m := a.move(o)
	switch {
	case m != nil:
		// Failed for good (attempts exhausted, maybe): the move says why.
		w.Move = m
		reply.Outcome, reply.Error = wire.OutcomeFailed, m.StepError
	case o.Status == wire.OutcomeFailed:
		reply.Outcome = wire.OutcomeFailed
	default:
		reply.Outcome = wire.OutcomeRetry
	}
	w.InboxOutcome = "failed"
	if reply.Outcome == wire.OutcomeRetry {
		w.InboxOutcome = "retry"
	}
	w.Proof = w.InboxOutcome
	w.ErrText = reply.Error
	msg, err := a.replyMessage(reply)
	if err != nil {
		return reply, err
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	var out store.Recorded
	if c := a.conn.Conn(); !c.IsClosed() && c.PgConn().TxStatus() != 'I' {
		w.Lead = store.LeadFailure
		tx.Exec(store.RollbackToClaim, nil)
		if out, err = a.commitWrite(rctx, tx, w, msg); err == nil {
			return a.failureRecorded(rctx, w, m, &out, reply)
		}
		// The claim's transaction ended without the record: nothing of
		// it stays, and the failure is recorded alone.
	}
	w.Lead = store.LeadFailureAlone
	send := func(c *pgx.Conn) error {
		tx := store.Implicit(c, a.r.cfg.Schema)
		if c.PgConn().TxStatus() != 'I' {
			tx.Exec("rollback", nil)
		}
		a.unconsume()
		var err error
		out, err = a.commitWrite(rctx, tx, w, msg)
		return err
	}
	if c := a.conn.Conn(); !c.IsClosed() {
		err = send(c)
		if err == nil {
			return a.failureRecorded(rctx, w, m, &out, reply)
		}
		if !c.IsClosed() && c.PgConn().TxStatus() == 'I' {
			return reply, fmt.Errorf("record the failure (%s): %w", reply.Error, err)
		}
	}
	// The connection broke (a statement cut by the attempt's timeout, a
	// restarted server): give it back first (the pool closes it), so that
	// a pool whose connections all broke at once does not wait on itself,
	// and record the failure on another one.
	tx.Rollback(rctx)
	a.conn.Release()
	a.conn = nil
	if err := a.r.cfg.Pool.AcquireFunc(rctx, func(c *pgxpool.Conn) error { return send(c.Conn()) }); err != nil {
		return reply, fmt.Errorf("record the failure (%s): %w", reply.Error, err)
	}
	return a.failureRecorded(rctx, w, m, &out, reply)
}

// failureRecorded finishes recordFailure once w's statement committed: an
// outcome stored under the key meanwhile (or the claim the handler
// committed itself) answers instead of the failure.
func (a *attempt) failureRecorded(ctx context.Context, w store.Record, m *store.Move, out *store.Recorded, reply wire.Reply) (wire.Reply, error) {
	if !out.Led {
		if a.conn != nil {
			return a.answerConflict(ctx, a.conn.Conn(), w)
		}
		var reply wire.Reply
		err := a.r.cfg.Pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
			var err error
			reply, err = a.answerConflict(ctx, c.Conn(), w)
			return err
		})
		return reply, err
	}
	// The inbox holds the attempt's end, final or not: another delivery
	// of it answers from memory.
	a.stored = true
	a.afterMove(m, out)
	return reply, nil
}

// answerConflict answers, on c, an attempt whose record met an outcome
// stored under its key, or found its saga gone.
func (a *attempt) answerConflict(ctx context.Context, c *pgx.Conn, w store.Record) (wire.Reply, error) {
	st, found, err := readStoredOn(ctx, c, a.r.cfg.Schema, w.Saga, w.Key)
	switch {
	case err != nil:
		return a.replyBase(), err
	case !found:
		return a.sagaGone()
	}
	a.conflict = true
	return a.answerStored(ctx, c, st, true)
}

// idleTimeoutFor is the longest a step transaction may sit idle: the
// attempt's timeout plus a margin. PostgreSQL ends the session past it.
func idleTimeoutFor(p saga.RetryPolicy) string {
	return fmt.Sprintf("%dms", (p.Timeout + 5*time.Second).Milliseconds())
}
