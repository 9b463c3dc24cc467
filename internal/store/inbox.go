package store

import "fmt"

// NotPaused holds for a saga s that may start an attempt: neither it nor
// its definition is paused. Every claim checks it in its own statement,
// so no attempt starts once a pause committed.
const NotPaused = `s.paused_at is null and not exists (select 1 from idemsaga.paused_definitions p where p.definition = s.definition)`

// PausedRead reads whether saga $1 is paused, itself or with its
// definition, for a claim that took nothing; no row when it is gone.
const PausedRead = `select not (` + NotPaused + `) from idemsaga.sagas s where s.id = $1`

// The inbox's statements. None raises on a normal outcome: a key already
// held is told by what a statement returns, not by an error, so the
// server's log stays clean of duplicates.
var (
	// ClaimDatabase is a database step's claim, sent after BEGIN: the inbox row
	// goes in first, before any business write, so a concurrent duplicate
	// waits on the key and then finds the committed outcome; if the
	// attempt rolls back, so does the row. The key is taken from nothing,
	// or from an earlier attempt that ended without effect (retry); a key
	// that holds this attempt's end, a later attempt or a final outcome
	// (or a saga gone) is left as it is and returns no row: the caller then
	// reads what the inbox holds (ReadStored). The claim takes its key's advisory lock
	// shared for the whole attempt (see LockClass), and bounds how long
	// the transaction may sit idle ($7): a stalled process must not hold
	// the key forever. Both are filters on the saga's row, so they hold
	// whether or not the key was free, rather than a join on a one-row
	// subquery and a CTE's count: a plain INSERT starts fewer executor
	// nodes, 27,000 instructions less per step under callgrind
	// (bench/pg-instructions.sh).
	ClaimDatabase = fmt.Sprintf(`insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome)
select s.id, $2, $3, $4::text, $5::int, 'succeeded'
from idemsaga.sagas s
where s.id = $1 and `+NotPaused+` and pg_advisory_xact_lock_shared(%d, $6) is not null
  and set_config('idle_in_transaction_session_timeout', $7, true) is not null
on conflict (saga_id, step_key) do update set attempt = excluded.attempt, outcome = 'succeeded', error = null, result = null
  where x.outcome = 'retry' and x.attempt < excluded.attempt
returning 1`, LockClass)

	// SavepointClaim follows a database step's claim: a handler that fails
	// rolls back to it (RollbackToClaim), undoing its writes and keeping
	// the claim, and its failure is recorded in the same transaction. The
	// key is never seen free between the two, so a delivery that waited on
	// it finds the failure and does not run the handler again.
	SavepointClaim  = "savepoint idemsaga_claim"
	RollbackToClaim = "rollback to savepoint idemsaga_claim"

	// ClaimCall is an external attempt's claim, in a transaction of its
	// own committed before the call: the key's row becomes started at this
	// attempt, from nothing or from an earlier attempt that ended (retry)
	// or whose process never recorded an outcome (started, at a lower
	// attempt: that one's outcome is now unknown). A row at this attempt
	// or a later one, or a final outcome, is left as it is: a duplicate of
	// a call in flight does not call again. It returns a row when it
	// claimed: whether an earlier attempt's outcome is unknown (and not
	// since answered "not done" by the step's Verify), for the attempt to
	// verify before it calls again.
	ClaimCall = fmt.Sprintf(`insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome)
select s.id, $2, $3, $4::text, $5::int, 'started'
from idemsaga.sagas s
where s.id = $1 and `+NotPaused+` and pg_advisory_xact_lock_shared(%d, $6) is not null
on conflict (saga_id, step_key) do update
  set attempt = excluded.attempt, outcome = 'started', error = null,
      unknown = x.unknown or x.outcome = 'started',
      verified = x.verified and x.outcome <> 'started'
  where x.outcome in ('started', 'retry') and x.attempt < excluded.attempt
returning unknown`, LockClass)

	// FenceForward comes first in a compensation: the forward key's row
	// becomes a tombstone unless its outcome is final, so no late delivery
	// of the forward command can take effect after this. A forward call
	// still marked started, or a callback step's request that waits for
	// its callback, is possibly done (unknown).
	FenceForward = `insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome)
select s.id, $2, $3, 'forward', 0, 'tombstone' from idemsaga.sagas s where s.id = $1
on conflict (saga_id, step_key) do update
  set outcome = 'tombstone', unknown = x.unknown or x.outcome in ('started', 'waiting'),
    verified = x.verified and x.outcome not in ('started', 'waiting')
  where x.outcome in ('started', 'retry', 'waiting')`

	// ReadStored reads what the inbox holds for a key: a duplicate's
	// answer, a forward step's outcome for its compensation. A success
	// applied to its saga in its own transaction keeps its result in the
	// step's row alone.
	ReadStored = `select i.outcome::text, coalesce(i.result, st.result), coalesce(i.error, ''), i.attempt, i.unknown, i.verified
from idemsaga.inbox i
left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
  and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'
where i.saga_id = $1 and i.step_key = $2`
)

// ClaimLease restarts the lease of a dispatched step at its attempt ($4)
// from now ($5 ms) and marks the attempt claimed, so that the reaper
// counts its expiry: a command delivered late or again, or an attempt's
// heartbeat. It returns a row while the attempt is still the step's.
// Losing it in a crash only leaves the lease running from before: it
// commits without waiting for the WAL's flush.
const ClaimLease = `update idemsaga.steps set lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', claimed_attempt = $4
where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'
  and set_config('synchronous_commit', 'off', true) is not null
returning 1`

// ParkCommand parks a command in the dead-letter table, once per message
// id, for a saga that exists; it returns the row's id when it parked it.
const ParkCommand = `insert into idemsaga.dead_letters (msg_id, subject, payload, headers, saga_id, definition, definition_version,
  step, phase, attempt, reason, deliveries, parked_by, first_seen)
select $1, $2, $3, $4, s.id, $6, $7, $8, $9::text::idemsaga.phase, $10, $11, $12, $13, $14
from idemsaga.sagas s where s.id = $5
on conflict (msg_id) do nothing
returning id`

// DeleteCommand consumes an eagerly run command's outbox row ($1).
const DeleteCommand = `delete from idemsaga.outbox where id = $1`
