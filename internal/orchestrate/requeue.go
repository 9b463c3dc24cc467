package orchestrate

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/idemsaga/idemsaga/internal/plan"

	"github.com/idemsaga/idemsaga/internal/maintenance"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// requeueTimerMax bounds how far the dispatch timer of a command still
// queued is pushed at once: past it, the stream is looked at again.
const requeueTimerMax = 30 * time.Second

// requeueMargin is how much younger than the step's dispatch the stream's
// oldest message may look and the command still count as queued: the
// broker's clock and the database's differ, and the relay publishes a
// moment after the commit.
const requeueMargin = 2 * time.Second

// requeuePlan is what a requeue does with an unclaimed command.
type requeuePlan struct {
	// send writes the command again, under msgSuffix appended to its
	// message id (empty: the same id, which the stream's duplicate window
	// drops while the first copy is still there).
	send      bool
	msgSuffix string
	// lost says the command left the queue unclaimed: a worker received
	// it and died, or could not run it (its definition unknown there), or
	// the broker lost it. Lost twice at one attempt, the attempt counts
	// as started (store.RequeueStep): otherwise a handler that kills its process,
	// or a command no worker runs, would be sent again forever at one
	// attempt.
	lost bool
	// timer is the new dispatch timer.
	timer time.Duration
	how   string
}

// planRequeue decides for a command dispatched queued ago whose lease ran
// out unclaimed. While the oldest message no worker was given yet is at
// least as old as the command, the command may be among them (a consumer
// delivers in stream order): nothing is sent, and the timer doubles, so that
// a long queue costs a handful of looks. When the queue is younger or empty,
// the command was delivered to a worker that died or lost it, or the
// broker lost it: it is sent again under a new message id at the same
// attempt (a copy a live worker still holds is absorbed by the inbox); lost
// a second time, the attempt counts as claimed. With the stream's state
// unknown (the broker out of reach), it is sent again under its own id and
// counts nothing: an outage spends no attempt.
func planRequeue(lease, queued time.Duration, b maintenance.Backlog, known bool, now time.Time) requeuePlan {
	switch {
	case !known:
		return requeuePlan{send: true, timer: lease, how: "resent"}
	case b.Msgs > 0 && b.OldestAge(now)+requeueMargin >= queued:
		return requeuePlan{timer: min(max(lease, queued), max(lease, requeueTimerMax)), how: "queued"}
	default:
		return requeuePlan{send: true, msgSuffix: "-q" + strconv.FormatInt(queued.Milliseconds(), 10), timer: lease, how: "resent", lost: true}
	}
}

// claimRunning restarts the lease of an attempt found running with its
// lease run out, and marks it claimed: its next expiry is a takeover.
func (c *Core) claimRunning(tx *store.Tx, def *saga.Definition, id stepID, idx, attemptNo int) {
	lease := c.plan.LeaseMillis(plan.PolicyOf(def, idx, id.phase))
	tx.Exec(store.MarkClaimed, nil, pguuid.Of(id.saga), id.step, string(id.phase), attemptNo, lease)
}

// requeue keeps step idx of sg at its attempt after its lease ran out with
// no worker having claimed the command, as planRequeue decides.
func (c *Core) requeue(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, verify bool, queued time.Duration) (string, error) {
	policy := plan.PolicyOf(def, idx, phase)
	lease := time.Duration(c.plan.LeaseMillis(policy)) * time.Millisecond
	var b maintenance.Backlog
	known := false
	if c.out != nil {
		b, known = c.out.Backlog(ctx)
	}
	plan := planRequeue(lease, queued, b, known, time.Now())
	var subject, msgID any
	var payload []byte
	if plan.send {
		s, id, p, err := c.plan.Command(sg, def, idx, phase, attemptNo, verify)
		if err != nil {
			return "", err
		}
		subject, msgID, payload = s, id+plan.msgSuffix, p
	}
	name := def.Step(idx).Name
	tx.Queue(store.RequeueStep, func(row pgx.Row) error {
		var found bool
		var outboxID *int64
		if err := row.Scan(&found, &outboxID); err != nil {
			return fmt.Errorf("keep step %q (%s) of saga %s at its attempt: %w", name, phase, sg.ID, err)
		}
		if !found || plan.send && outboxID == nil {
			return fmt.Errorf("keep step %q (%s) of saga %s at its attempt: %w", name, phase, sg.ID, store.ErrInvariant)
		}
		if outboxID != nil {
			tx.Sent(outboxCommitted(*outboxID, subject.(string), msgID.(string), payload, tx.Trace()))
		}
		return nil
	}, pguuid.Of(sg.ID), name, string(phase), attemptNo, plan.timer.Milliseconds(), subject, msgID, payload, c.handOffFor(tx), store.HeadersJSON(tx.Trace()), plan.lost)
	return plan.how, nil
}
