package attempt

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// claim is what a database step's claim reports once sent: whether it
// took the key and, for a compensation, the forward key's outcome.
type claim struct {
	taken bool
	fwd   *stored
}

// queueClaim queues, on tx (open, explicit), the claim of one attempt of a
// database step, and for a compensation the forward key's fence and read.
func queueClaim(tx *store.Tx, sagaID, key uuid.UUID, step string, phase saga.Phase, attemptNo int, policy saga.RetryPolicy) *claim {
	cl := &claim{}
	tx.Query(store.ClaimDatabase, func(rows pgx.Rows) error {
		for rows.Next() {
			cl.taken = true
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("claim step key: %w", err)
		}
		return nil
	}, pguuid.Of(sagaID), pguuid.Of(key), step, string(phase), attemptNo, store.LockID(key), idleTimeoutFor(policy))
	if phase == saga.PhaseCompensate {
		cl.fwd = &stored{}
		fwdKey := pguuid.Of(saga.StepKey(sagaID, step, saga.PhaseForward))
		tx.Exec(store.FenceForward, nil, pguuid.Of(sagaID), fwdKey, step)
		tx.Queue(store.ReadStored, cl.fwd.scan(nil), pguuid.Of(sagaID), fwdKey)
	}
	tx.Exec(store.SavepointClaim, nil)
	return cl
}

// preclaim is the claim of the step a move dispatched, sent in the round
// trip of the move's COMMIT: the step runs next in this process (eager),
// and its attempt starts from this transaction, already claimed, instead
// of a round trip of its own. It holds its connection until the attempt
// takes it or close gives it back.
type preclaim struct {
	conn *pgxpool.Conn
	tx   *store.Tx
	// key and attempt name the claim, for the attempt to check it is its
	// own.
	key     uuid.UUID
	attempt int
	claim   *claim
	// first, for a claim begun with its saga's start (Runner.Carry), is
	// the step's row, which the start left to the attempt.
	first *store.FirstStep
}

// chainable reports whether the step m dispatches is a database step whose
// claim can travel with the move's COMMIT: it runs here at once.
func (a *attempt) chainable(w store.Record) bool {
	m := w.Move
	if !w.Eager || m == nil || m.Next == nil || a.conn == nil {
		return false
	}
	if m.Next.Index < 0 || m.Next.Index >= a.def.Len() {
		return false
	}
	return a.def.Step(m.Next.Index).Kind == saga.DatabaseStep
}

// policyOf is the retry policy of the dispatched step's phase.
func policyOf(def *saga.Definition, d *store.Dispatch) saga.RetryPolicy {
	st := def.Step(d.Index)
	if d.Phase == saga.PhaseCompensate {
		return st.CompensateRetry
	}
	return st.Retry
}

// close rolls the claim back and gives its connection back.
func (p *preclaim) close(ctx context.Context) {
	if p == nil || p.conn == nil {
		return
	}
	p.tx.Rollback(ctx)
	p.conn.Release()
	p.conn = nil
}
