package sagatest

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// The kit moves the clock only while nothing is on its way: a command or
// reply written and not yet published, waiting in the stream, in a
// worker's hands, or being written by an open transaction. A lease the
// clock passed otherwise would be taken over while its command still
// waits for a busy worker, and the step run again beside it.
const (
	// outboxSeq is the last outbox id taken, committed or not: every
	// command and reply the engine writes takes one.
	outboxSeq = `coalesce(pg_sequence_last_value(pg_get_serial_sequence('idemsaga.outbox', 'id')::regclass), 0)`
	// writing holds while another transaction writes steps or the
	// outbox: it may be dispatching a step with a lease on the clock as
	// it is.
	writing = `exists (select 1 from pg_locks l where l.locktype = 'relation' and l.granted and l.pid <> pg_backend_pid()
  and l.mode = 'RowExclusiveLock' and l.relation in ('idemsaga.steps'::regclass, 'idemsaga.outbox'::regclass))`

	// tree is saga $1 and its children, theirs, and so on: a parent
	// waits while its children move.
	tree = `with recursive tree(id) as (
  select $1::uuid
  union all
  select c.id from idemsaga.sagas c join tree on c.parent_id = tree.id
) `

	// waitFor reads, in one snapshot, how long until what saga $1 or a
	// child of it waits for: a due retry; with $2, the lease of a
	// dispatched step; with $3, the wait of a callback step, or of a
	// child step whose child is parked (a child that runs is waited for,
	// not skipped). It also reads the outbox's sequence, and whether
	// anything is written or unpublished.
	waitFor = tree + `select (select min(due) - idemsaga.now() from (
  select next_attempt_at as due from idemsaga.steps where saga_id in (select id from tree) and status = 'retrying'
  union all
  select lease_until from idemsaga.steps where saga_id in (select id from tree) and status = 'dispatched' and $2
  union all
  select st.lease_until from idemsaga.steps st where st.saga_id in (select id from tree) and st.status = 'waiting' and $3
    and not exists (select 1 from idemsaga.sagas c where c.parent_id = st.saga_id and c.parent_step = st.step and c.state <> 'parked')
) d), ` + outboxSeq + `, ` + writing + ` or exists (select 1 from idemsaga.outbox where published_at is null)`

	// signature changes whenever saga $1 or a child of it moves; the
	// second column says whether $1 finished.
	signature = tree + `select string_agg(s.version || '/' || s.state || '/' || (select count(*) from idemsaga.step_attempts a where a.saga_id = s.id)
  || '/' || coalesce((select max(updated_at)::text from idemsaga.steps st where st.saga_id = s.id), ''), ',' order by s.id),
  bool_or(s.id = $1 and s.finished_at is not null)
from idemsaga.sagas s where s.id in (select id from tree)`

	// advanceIfStill moves the clock by $1 ms if no outbox id was taken
	// since $2 was read and nothing is being written.
	advanceIfStill = `update sagatest.clock set offset_ms = offset_ms + $1
where ` + outboxSeq + ` = $2 and not ` + writing
)

// skip moves the clock to the next moment saga id (or a child of it)
// waits for, once nothing
// is on its way: a retry's due time; once the saga has been quiet for a
// while, the lease of an attempt nobody is running; and once it has been
// quiet for longer, the deadline of a callback step that waits for a
// callback (which another goroutine of the test may still be sending). It
// reports whether it moved.
func (e *Env) skip(ctx context.Context, t T, id uuid.UUID, quiet time.Duration) bool {
	t.Helper()
	leases, waits := quiet > 200*time.Millisecond, quiet > time.Second
	var wait *time.Duration
	var seq int64
	var busy bool
	if err := e.Pool.QueryRow(ctx, waitFor, id, leases, waits).Scan(&wait, &seq, &busy); err != nil {
		t.Fatalf("sagatest: read what saga %s waits for: %v", id, err)
	}
	if busy || wait == nil || *wait <= 0 {
		return false
	}
	// Read after the snapshot above: a command published since is in the
	// stream or a worker's hands now, or has been answered, its answer
	// taking an outbox id.
	if n, err := e.queued(ctx); err != nil {
		t.Fatalf("sagatest: read the stream: %v", err)
	} else if n > 0 || e.hooks.InHand() > 0 {
		return false
	}
	tag, err := e.Pool.Exec(ctx, advanceIfStill, (*wait + time.Millisecond).Milliseconds(), seq)
	if err != nil {
		t.Fatalf("sagatest: %v", fmt.Errorf("move the clock: %w", err))
	}
	return tag.RowsAffected() == 1
}

// queued returns how many messages the stream holds: commands and replies
// no worker received yet, or received and not yet acknowledged.
func (e *Env) queued(ctx context.Context) (uint64, error) {
	s, err := e.js.Stream(ctx, kitStream)
	if err != nil {
		return 0, err
	}
	return s.CachedInfo().State.Msgs, nil
}
