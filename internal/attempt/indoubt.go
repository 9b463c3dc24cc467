package attempt

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/outbox"
)

// A COMMIT whose answer was lost (the server crashed or failed over, the
// connection broke) may have committed. An attempt that took such an
// error for a failure would lose what only its process knew: the command
// of the step its move dispatched, run here at once without an outbox row
// (its lease would drive it again, a lease later), and the rows it was to
// publish (the relay's sweep would take them, a hand-off later). So the
// attempt asks the database, once it answers again, whether its write
// committed, from what only that commit leaves: the inbox row of the
// attempt at its outcome (write.proof).

// inDoubt reports whether err, from the batch that carried a transaction's
// COMMIT, leaves the transaction's outcome unknown: the batch was sent, and
// no answer from the server says it failed.
func inDoubt(err error) bool {
	var pgErr *pgconn.PgError
	// Anything else (the connection broke, or the attempt's own deadline
	// cut the batch) may have come after the COMMIT reached the server.
	return err != nil && !errors.As(err, &pgErr) && !pgconn.SafeToRetry(err)
}

// resolveTimeout bounds how long an attempt waits for the database to
// answer whether a commit in doubt committed: a failover's length. Past it
// the attempt counts as not committed, and what it dispatched is driven
// again by its lease and the relay's sweep.
const resolveTimeout = 30 * time.Second

// resolveEvery is the pause between tries while the database is away.
const resolveEvery = 100 * time.Millisecond

// readCommitted reads back, for write w of an attempt: the outcome the
// inbox holds for its key at its attempt, the status of its step at its
// attempt, whether the step its move dispatches exists, and the outbox
// rows of the next command ($6) and of the reply ($7) still unpublished,
// with the saga's start.
const readCommitted = `select
  (select outcome::text from idemsaga.inbox where saga_id = $1 and step_key = $2 and attempt = $3),
  (select status::text from idemsaga.steps where saga_id = $1 and step = $4 and phase = $5 and attempt = $3),
  exists (select 1 from idemsaga.steps where saga_id = $1 and step = $8 and phase = $9),
  (select min(id) from idemsaga.outbox where saga_id = $1 and msg_id = $6 and published_at is null),
  (select min(id) from idemsaga.outbox where saga_id = $1 and msg_id = $7 and published_at is null),
  (select created_at from idemsaga.sagas where id = $1)`

// resolve finds out whether w, whose COMMIT is in doubt, committed. It
// returns what the write's statement would have reported and true if it
// did, false if it did not or the database did not answer in time.
func (a *attempt) resolve(ctx context.Context, w store.Record, reply *outbox.Message) (store.Recorded, bool) {
	if w.Proof == "" {
		return store.Recorded{}, false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resolveTimeout)
	defer cancel()
	var nextStep, nextPhase, nextMsg, replyMsg any
	if w.Move != nil && w.Move.Next != nil {
		nextStep, nextPhase, nextMsg = w.Move.Next.Step, string(w.Move.Next.Phase), w.Move.Next.MsgID
	}
	if reply != nil {
		replyMsg = reply.MsgID
	}
	for {
		var outcome, status *string
		var dispatched bool
		var nextID, replyID *int64
		var created *time.Time
		err := a.r.db().QueryRow(ctx, readCommitted, pguuid.Of(w.Saga), pguuid.Of(w.Key), w.Attempt, w.Step, string(w.Phase),
			nextMsg, replyMsg, nextStep, nextPhase).Scan(&outcome, &status, &dispatched, &nextID, &replyID, &created)
		if err == nil {
			if outcome == nil || *outcome != w.Proof {
				return store.Recorded{}, false
			}
			out := store.Recorded{Led: true, ReplyID: replyID}
			if m := w.Move; m != nil && status != nil && *status == string(m.Status) && created != nil {
				out.Moved, out.Created = true, *created
				out.Dispatched = m.Next != nil && dispatched
				out.NextID = nextID
			}
			return out, true
		}
		if errors.Is(err, pgx.ErrNoRows) || ctx.Err() != nil {
			return store.Recorded{}, false
		}
		select {
		case <-ctx.Done():
			return store.Recorded{}, false
		case <-time.After(resolveEvery):
		}
	}
}

// committedRows are the outbox rows a write resolved as committed left to
// publish.
func committedRows(w store.Record, reply *outbox.Message, out store.Recorded) []outbox.Committed {
	var rows []outbox.Committed
	if out.NextID != nil {
		d := w.Move.Next
		rows = append(rows, outbox.Committed{ID: *out.NextID, Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers})
	}
	if out.ReplyID != nil && reply != nil {
		rows = append(rows, outbox.Committed{ID: *out.ReplyID, Subject: reply.Subject, MsgID: reply.MsgID, Payload: reply.Payload, Headers: reply.Headers})
	}
	return rows
}
