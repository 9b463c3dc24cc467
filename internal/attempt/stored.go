package attempt

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// stored is what the inbox holds for a step key.
type stored struct {
	outcome string
	result  []byte
	errText string
	attempt int
	unknown bool
	// verified: the step's Verify answered, after the last attempt whose
	// outcome was unknown, that the key took no effect.
	verified bool
}

// final reports an outcome no attempt changes any more.
func (st stored) final() bool {
	return st.outcome == "succeeded" || st.outcome == "failed" || st.outcome == "tombstone"
}

// endedAt reports a key that holds the end of attempt n, or of a later
// attempt, without a final outcome (retry): a delivery of attempt n does
// not run it again.
func (st stored) endedAt(n int) bool { return st.outcome == "retry" && st.attempt >= n }

// undo reports whether a compensation must run for a forward step whose
// key holds st (after store.FenceForward): it succeeded, or some attempt of it
// had an unknown outcome, even if its Verify answered since that the key
// took no effect (the compensation voids the key against a request still
// on its way).
func (st stored) undo() bool { return st.outcome == "succeeded" || st.unknown || st.verified }

// scan reads a row of store.ReadStored into st; found, if not nil, is false for
// no row (st then stays the zero value: nothing stored).
func (st *stored) scan(found *bool) func(pgx.Row) error {
	set := func(v bool) {
		if found != nil {
			*found = v
		}
	}
	return func(row pgx.Row) error {
		err := row.Scan(&st.outcome, &st.result, &st.errText, &st.attempt, &st.unknown, &st.verified)
		if errors.Is(err, pgx.ErrNoRows) {
			set(false)
			return nil
		}
		if err != nil {
			return fmt.Errorf("read the inbox: %w", err)
		}
		set(true)
		if string(st.result) == "null" {
			st.result = nil
		}
		return nil
	}
}

// readStoredOn reads what the inbox holds for a key.
func readStoredOn(ctx context.Context, conn interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, schema *pgschema.Schema, sagaID, key uuid.UUID) (stored, bool, error) {
	var st stored
	var found bool
	err := st.scan(&found)(conn.QueryRow(ctx, schema.SQL(store.ReadStored), pguuid.Of(sagaID), pguuid.Of(key)))
	return st, found, err
}

// reply fills r with the stored outcome, as a duplicate.
func (st stored) reply(r wire.Reply) (wire.Reply, error) {
	r.Duplicate = true
	switch st.outcome {
	case "succeeded":
		r.Outcome, r.Result = wire.OutcomeSucceeded, st.result
	case "failed":
		r.Outcome, r.Error = wire.OutcomeFailed, st.errText
	case "tombstone":
		// The engine gave this step up, or a compensation fenced it;
		// there is nobody to answer.
		r.Outcome, r.Error = wire.OutcomeFailed, "the step was given up before this delivery"
	default:
		return r, fmt.Errorf("the inbox holds an outcome of its own, %q, for key %s; deploy step workers of this build", st.outcome, r.Key)
	}
	return r, nil
}

// answerStored answers a delivery whose key the inbox holds with a final
// outcome, on conn (outside any transaction). The same attempt delivered
// again wrote its reply or move with that outcome: nothing is store.Recorded
// (unless force: this attempt found the outcome while recording its own,
// and nothing of it was store.Recorded). Another attempt's outcome is answered
// for this one: a success is applied as this attempt's, in the step if
// the plan allows; anything else with a reply.
func (a *attempt) answerStored(ctx context.Context, conn *pgx.Conn, st stored, force bool) (wire.Reply, error) {
	reply, err := st.reply(a.replyBase())
	if err != nil {
		return reply, err
	}
	if !force && st.attempt == a.cmd.Attempt && st.outcome != "tombstone" {
		a.stored = true
		return reply, nil
	}
	tx := store.Implicit(conn, a.r.cfg.Schema)
	w := store.Record{Lead: store.LeadNone, Saga: a.cmd.SagaID, Key: a.cmd.Key, Step: a.cmd.Step, Phase: a.cmd.Phase, Attempt: a.cmd.Attempt, HandOff: a.handOff()}
	var m *store.Move
	if st.outcome == "succeeded" {
		w.Result = st.result
		m = a.move(Outcome{Status: wire.OutcomeSucceeded, Result: st.result})
		w.Move = m
	}
	msg, err := a.replyMessage(reply)
	if err != nil {
		return reply, err
	}
	out, err := a.commitWrite(ctx, tx, w, msg)
	if err != nil {
		return reply, fmt.Errorf("answer a duplicate delivery: %w", err)
	}
	a.afterMove(m, &out)
	a.stored = st.outcome != "tombstone"
	return reply, nil
}

// ended answers a delivery of an attempt of a database step that ended,
// its end stored under the key (retry), or a later attempt's: the handler
// does not run again, nothing is store.Recorded, and the delivery is dropped. The
// attempt's reply was store.Recorded with its end.
func (a *attempt) ended(st stored) (wire.Reply, error) {
	a.dropped = true
	reply := a.replyBase()
	reply.Outcome, reply.Duplicate = wire.OutcomeRetry, true
	reply.Error = st.errText
	if st.attempt != a.cmd.Attempt {
		reply.Error = fmt.Sprintf("attempt %d of the step ended before this delivery of attempt %d", st.attempt, a.cmd.Attempt)
	}
	return reply, nil
}

// held answers a command of a paused saga (or of a saga whose definition
// is paused): no attempt starts, nothing is store.Recorded, and the delivery is
// dropped. The step's row keeps its attempt; resuming the saga sends the
// command again at that same attempt.
func (a *attempt) held() (wire.Reply, error) {
	a.dropped = true
	a.r.cfg.Metrics.CommandsHeld.WithLabelValues(a.cmd.Definition, a.cmd.Step, string(a.cmd.Phase)).Inc()
	a.r.cfg.Logger.Info("step worker: command of a paused saga held; resuming the saga sends it again",
		"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "phase", a.cmd.Phase, "attempt", a.cmd.Attempt)
	reply := a.replyBase()
	reply.Outcome, reply.Error, reply.Duplicate = wire.OutcomeRetry, "the saga is paused", true
	return reply, nil
}

// scanPaused scans store.PausedRead into paused; a saga gone is not paused.
func scanPaused(paused *bool) func(pgx.Row) error {
	return func(row pgx.Row) error {
		if err := row.Scan(paused); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		return nil
	}
}

// sagaGone answers a command whose saga no longer exists (deleted past
// its retention window, or by hand): nothing can be recorded for it.
func (a *attempt) sagaGone() (wire.Reply, error) {
	a.dropped = true
	a.r.cfg.Logger.Warn("step worker: command for a saga that no longer exists; dropped",
		"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "phase", a.cmd.Phase, "attempt", a.cmd.Attempt)
	reply := a.replyBase()
	reply.Outcome, reply.Error, reply.Duplicate = wire.OutcomeFailed, "the saga no longer exists", true
	return reply, nil
}

// checkKind refuses a stored outcome that only the other kind of step
// writes (a step whose kind changed between builds, with attempts of both
// in flight).
func (a *attempt) checkKind(st stored) error {
	if a.step.Kind == saga.DatabaseStep && (st.outcome == "started" || st.outcome == "waiting" || st.unknown) {
		return fmt.Errorf("step %q is a database step, but its key's inbox row says %q, as an external step's does; deploy one definition to every worker", a.cmd.Step, st.outcome)
	}
	return nil
}
