package attempt

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Carry runs the first attempt of a new saga's first step in the
// transaction that starts the saga, so that the start and the step's
// outcome commit once. first is the saga's first command as the start
// would write it, and row its step's row; start queues the start's
// statements on the transaction (writing neither) and returns what
// tells, once they ran, whether they inserted the saga. The attempt
// writes row once it ends (store.FirstStep).
//
// It returns true once that transaction committed. False means it left
// nothing committed, or cannot tell: the first step is not a database
// step this runner would run at once, no slot is free, the start
// inserted nothing (a duplicate: the caller answers from what its
// statement saw), the claim was not taken (a paused definition), or the
// attempt ended without its commit; the caller then starts the saga
// alone, and a saga found under its key with its own ID is its own. The attempt runs
// under the runner's work, not ctx: a caller that gives up gets ctx's
// error at once (the saga may still start), and spends no attempt. The
// steps the attempt's move dispatched run on here, after Carry returns.
func (r *Runner) Carry(ctx context.Context, first outbox.Committed, row store.FirstStep, start func(tx *store.Tx) (inserted func() bool)) (bool, error) {
	if r.slots == nil || r.cfg.Mover == nil || !r.cfg.Eager || r.cfg.Publisher == nil {
		return false, nil
	}
	cmd, err := wire.DecodeCommand(first.Payload)
	if err != nil || cmd.Phase != saga.PhaseForward || cmd.Attempt != 1 {
		return false, nil
	}
	cmd.Trace = first.Headers
	def, idx, err := r.lookup(cmd)
	if err != nil || def.Step(idx).Kind != saga.DatabaseStep {
		return false, nil
	}
	// The attempt holds a slot and counts among the offers Serve waits
	// for, as an offered command does.
	r.serveMu.RLock()
	if !r.serving || r.draining.Load() {
		r.serveMu.RUnlock()
		return false, nil
	}
	select {
	case r.slots <- struct{}{}:
	default:
		r.serveMu.RUnlock()
		return false, nil
	}
	r.inHand.Add(1)
	work := r.work
	committed := make(chan bool, 1)
	r.offers.Go(func() {
		defer r.inHand.Add(-1)
		defer func() { <-r.slots }()
		// The caller's values (its trace) without its end: the
		// runner's work ends the attempt.
		actx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		defer cancel()
		defer context.AfterFunc(work, cancel)()
		given := r.claimWithStart(actx, cmd, def.Step(idx).Retry, row, start)
		if given == nil {
			committed <- false
			return
		}
		tx := given.tx
		_, a, err := r.run(actx, cmd, false, 0, given, false)
		committed <- tx.Committed()
		if err != nil || a == nil || a.next == nil {
			if a != nil {
				a.pre.close(actx)
			}
			return
		}
		// The chain goes on as an offered command's does.
		r.runEager(work, a.next, a.pre)
	})
	r.serveMu.RUnlock()
	select {
	case ok := <-committed:
		return ok, nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// claimWithStart begins a transaction with the start's statements and
// the claim of the saga's first attempt, in one round trip, and returns
// it as the attempt's claim; nil when the start inserted nothing or the
// claim was not taken (rolled back, the connection given back).
func (r *Runner) claimWithStart(ctx context.Context, cmd wire.Command, policy saga.RetryPolicy, row store.FirstStep, start func(tx *store.Tx) func() bool) *preclaim {
	conn, err := r.cfg.Pool.Acquire(ctx)
	if err != nil {
		return nil
	}
	tx := store.Begin(conn.Conn(), r.cfg.Schema)
	inserted := start(tx)
	cl := queueClaim(tx, cmd.SagaID, cmd.Key, cmd.Step, cmd.Phase, cmd.Attempt, policy)
	if err := tx.Flush(ctx); err != nil || !inserted() || !cl.taken {
		tx.Rollback(ctx)
		conn.Release()
		return nil
	}
	return &preclaim{conn: conn, tx: tx, key: cmd.Key, attempt: cmd.Attempt, claim: cl, first: &row}
}

// placeFirstRow writes, with w, the step's row a carried start left to
// the attempt (a.first), if any: a success's move writes it in its final
// form, anything else after it is in. Once a write of the attempt queued
// the row, it may have committed (a handler's COMMIT lets a record after
// it run alone): the writes after it queue it again, which does nothing
// where it is in.
func (a *attempt) placeFirstRow(tx *store.Tx, w *store.Record) {
	if a.first == nil {
		return
	}
	if m := w.Move; m != nil && !a.firstQueued && w.Lead == store.LeadNone && m.Step == a.cmd.Step && m.Phase == a.cmd.Phase && m.Attempt == a.cmd.Attempt {
		m.First = true
		return
	}
	store.QueueFirstStep(tx, *a.first)
	a.firstQueued = true
}
