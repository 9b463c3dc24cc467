package engine

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// selectStepForReap reads a step under its saga's lock, and what the
// reaper may do with it. For an expired lease, claimed tells whether a
// worker claimed the attempt and restarted its lease then (claimed_attempt:
// a command that reached it late or again, or the reaper's own mark), and
// running whether an attempt holds the key now: its lock is held ($4 is
// the key's lock id, looked up in pg_locks rather than tried, which would
// make the key look busy to another reaper), or the inbox has the attempt
// started (an external call). An attempt whose outcome the inbox holds is
// neither, but answered: its reply (or the move it missed) is on its way.
// queued_ms is how long ago the attempt was dispatched.
var selectStepForReap = fmt.Sprintf(`select step_index, phase::text, status::text, attempt, possibly_done,
(status = 'retrying' and next_attempt_at <= idemsaga.now()) as due,
(status = 'dispatched' and lease_until < idemsaga.now() and next_attempt_at is null) as expired,
(status = 'dispatched' and next_attempt_at is not null and next_attempt_at <= idemsaga.now()) as resend,
exists (select 1 from idemsaga.sagas s where s.id = $1 and not (`+store.NotPaused+`)) as paused,
(status = 'waiting' and lease_until < idemsaga.now()) as waited,
case when status = 'dispatched' and lease_until < idemsaga.now() and next_attempt_at is null then coalesce(
  st.claimed_attempt = st.attempt and not exists (
    select 1 from idemsaga.inbox i where i.saga_id = st.saga_id and i.step_key = st.key and i.attempt >= st.attempt and i.outcome in ('succeeded', 'failed', 'retry')),
  false) else false end as claimed,
case when status = 'dispatched' and lease_until < idemsaga.now() and next_attempt_at is null then
  exists (select 1 from idemsaga.inbox i where i.saga_id = st.saga_id and i.step_key = st.key and i.attempt >= st.attempt and i.outcome = 'started')
  or exists (select 1 from pg_locks l where l.locktype = 'advisory' and l.granted and l.objsubid = 2
    and l.database = (select oid from pg_database where datname = current_database())
    and l.classid = %d and l.objid = ($4::bigint & 4294967295)::oid)
else false end as running,
exists (select 1 from idemsaga.inbox i where i.saga_id = st.saga_id and i.step_key = st.key and i.attempt >= st.attempt and i.outcome in ('succeeded', 'failed', 'retry')) as answered,
(extract(epoch from idemsaga.now() - coalesce(dispatched_at, created_at)) * 1000)::bigint as queued_ms
from idemsaga.steps st where saga_id = $1 and step = $2 and phase = $3`, store.LockClass)

// markClaimed marks an attempt found running without its worker's mark as
// claimed, with a lease from now ($5 ms): the lease of an attempt runs from
// its claim, and this is the latest its claim can have been.
const markClaimed = `update idemsaga.steps set claimed_attempt = attempt, lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', updated_at = idemsaga.now()
where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'`

// requeueStep keeps a dispatched step whose command no worker claimed at
// its attempt ($4), with a new dispatch timer ($5 ms), and, when $6 is not
// null, writes its command again ($6-$9: subject, message id, payload,
// hand-off, and $10 its headers). $11 says the command was found lost: the
// second time at one attempt, the attempt is marked claimed, and its next
// expiry is a takeover. The saga's version stays: the command is the one
// still on its way. It returns whether the step was there and
// the command's outbox id.
const requeueStep = `with r as (
  update idemsaga.steps set lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', updated_at = idemsaga.now(),
    claimed_attempt = case when $11 and resent_attempt = attempt then attempt else claimed_attempt end,
    resent_attempt = case when $11 then attempt else resent_attempt end
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched' and next_attempt_at is null
  returning saga_id
), o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after, headers)
  select $6::text, $7, $8, saga_id, clock_timestamp() + $9 * interval '1 millisecond', $10::jsonb from r where $6::text is not null
  returning id
)
select exists (select 1 from r), (select id from o)`

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
	// as started (requeueStep): otherwise a handler that kills its process,
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
func planRequeue(lease, queued time.Duration, b backlog, known bool, now time.Time) requeuePlan {
	switch {
	case !known:
		return requeuePlan{send: true, timer: lease, how: "resent"}
	case b.msgs > 0 && b.oldestAge(now)+requeueMargin >= queued:
		return requeuePlan{timer: min(max(lease, queued), max(lease, requeueTimerMax)), how: "queued"}
	default:
		return requeuePlan{send: true, msgSuffix: "-q" + strconv.FormatInt(queued.Milliseconds(), 10), timer: lease, how: "resent", lost: true}
	}
}

// claimRunning restarts the lease of an attempt found running with its
// lease run out, and marks it claimed: its next expiry is a takeover.
func (c *core) claimRunning(tx *store.Tx, def *saga.Definition, id stepID, idx, attemptNo int) {
	lease := c.leaseMillis(policyOf(def, idx, id.phase))
	tx.Exec(markClaimed, nil, pguuid.Of(id.saga), id.step, string(id.phase), attemptNo, lease)
}

// requeue keeps step idx of sg at its attempt after its lease ran out with
// no worker having claimed the command, as planRequeue decides.
func (c *core) requeue(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, queued time.Duration) (string, error) {
	policy := policyOf(def, idx, phase)
	lease := time.Duration(c.leaseMillis(policy)) * time.Millisecond
	var b backlog
	known := false
	if c.backlog != nil {
		b, known = c.backlog(ctx)
	}
	plan := planRequeue(lease, queued, b, known, time.Now())
	var subject, msgID any
	var payload []byte
	if plan.send {
		s, id, p, err := c.commandMessage(sg, def, idx, phase, attemptNo)
		if err != nil {
			return "", err
		}
		subject, msgID, payload = s, id+plan.msgSuffix, p
	}
	name := def.Step(idx).Name
	tx.Queue(requeueStep, func(row pgx.Row) error {
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
	}, pguuid.Of(sg.ID), name, string(phase), attemptNo, plan.timer.Milliseconds(), subject, msgID, payload, c.handOffArg(), store.HeadersJSON(tx.Trace()), plan.lost)
	return plan.how, nil
}
