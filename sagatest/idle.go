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

	// waitFor reads, in one snapshot, how long until what saga $1 waits
	// for: a due retry; with $2, the lease of a dispatched step; with $3,
	// the wait of a callback step. It also reads the outbox's sequence,
	// and whether anything is written or unpublished.
	waitFor = `select (select min(due) - idemsaga.now() from (
  select next_attempt_at as due from idemsaga.steps where saga_id = $1 and status = 'retrying'
  union all
  select lease_until from idemsaga.steps where saga_id = $1 and status = 'dispatched' and $2
  union all
  select lease_until from idemsaga.steps where saga_id = $1 and status = 'waiting' and $3
) d), ` + outboxSeq + `, ` + writing + ` or exists (select 1 from idemsaga.outbox where published_at is null)`

	// advanceIfStill moves the clock by $1 ms if no outbox id was taken
	// since $2 was read and nothing is being written.
	advanceIfStill = `update sagatest.clock set offset_ms = offset_ms + $1
where ` + outboxSeq + ` = $2 and not ` + writing
)

// skip moves the clock to the next moment saga id waits for, once nothing
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
