package store

import (
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Resend is a step's command sent again under its saga's lock: the step's
// attempt, fenced by the attempt seen, with a fresh lease, and the saga's
// version, read under the lock, which the statement bumps.
type Resend struct {
	Saga    uuid.UUID
	Step    string
	Phase   saga.Phase
	Attempt int
	Version int64
	// LeaseMillis is the lease from now, in milliseconds.
	LeaseMillis int64
	// Command is the command to write; HandOff its publish_after in
	// milliseconds, nil for the relay.
	Command outbox.Message
	HandOff any
	// Verify, for a redispatch, makes the next attempt one that asks the
	// step's Verify alone (wire.Command.Verify); the step's row records
	// it (verify_attempt), so that the command is written the same way
	// should it be sent again.
	Verify bool
}

// QueueRedispatch queues the next attempt (Attempt+1) of r's step, after
// its lease ran out or its retry came due, with its command; the attempt
// it ends goes into the timeline as 'lease expired' unless it is there
// already. A miss is a bug (ErrInvariant): the step was read under the
// saga's lock.
func QueueRedispatch(tx *Tx, r Resend) {
	tx.Queue(redispatchStep, func(row pgx.Row) error {
		var next *int
		var outboxID *int64
		var invariant *int
		if err := row.Scan(&next, &outboxID, &invariant); err != nil {
			return fmt.Errorf("dispatch step %q (%s) of saga %s again: %w", r.Step, r.Phase, r.Saga, err)
		}
		return r.sent(tx, outboxID, next != nil)
	}, append(r.args(), r.Verify)...)
}

// QueueResendAfterResume queues r's step sent again at its attempt after
// its saga was resumed, with a fresh lease and no claim. A miss is a bug
// (ErrInvariant).
func QueueResendAfterResume(tx *Tx, r Resend) {
	tx.Queue(resendStep, func(row pgx.Row) error {
		var outboxID *int64
		var invariant *int
		if err := row.Scan(&outboxID, &invariant); err != nil {
			return fmt.Errorf("send step %q (%s) of saga %s again: %w", r.Step, r.Phase, r.Saga, err)
		}
		return r.sent(tx, outboxID, true)
	}, r.args()...)
}

func (r Resend) args() []any {
	return []any{pguuid.Of(r.Saga), r.Step, string(r.Phase), r.Attempt, r.LeaseMillis, r.Version,
		r.Command.Subject, r.Command.MsgID, r.Command.Payload, r.HandOff, HeadersJSON(r.Command.Headers)}
}

// sent records the command's outbox row on tx, or reports the miss.
func (r Resend) sent(tx *Tx, outboxID *int64, moved bool) error {
	if outboxID == nil || !moved {
		return fmt.Errorf("send step %q (%s) of saga %s again at attempt %d: %w", r.Step, r.Phase, r.Saga, r.Attempt, ErrInvariant)
	}
	c := r.Command
	tx.Sent(outbox.Committed{ID: *outboxID, Subject: c.Subject, MsgID: c.MsgID, Payload: c.Payload, Headers: c.Headers})
	return nil
}
