package store

import "fmt"

// The statements of limits another system sets (saga.Limit), shared by
// every process on the database, and of an attempt that keeps its lease
// alive while it waits for them or calls.

// LimitLockClass is the first key of the advisory locks that serialize
// the holds of one (limit, scope): a count and an insert must not
// interleave. Its space is apart from LockClass's.
const LimitLockClass = 0x69646d6c // "idml"

// LockLimit takes the lock of limit $1's scope $2 until the transaction
// ends. It goes in a statement of its own, before TakeHold: a statement's
// snapshot is taken when it starts, so a count in the same statement as
// the lock would miss holds committed while it waited for the lock.
var LockLimit = fmt.Sprintf(`select pg_advisory_xact_lock(%d, hashtext($1 || '/' || $2))`, LimitLockClass)

// TakeHold, under LockLimit, drops the lapsed holds of limit $1's scope
// $2 and takes a hold for holder $3 (one turn) until $5 ms from now, if
// fewer than $4 others hold it. It returns a row when the hold is taken,
// none when the limit is full.
const TakeHold = `with gone as (
  delete from idemsaga.limit_holds where name = $1 and scope = $2 and until < idemsaga.now()
)
insert into idemsaga.limit_holds (name, scope, holder, until)
select $1, $2, $3, idemsaga.now() + $5::bigint * interval '1 millisecond'
where (select count(*) from idemsaga.limit_holds h
  where h.name = $1 and h.scope = $2 and h.until >= idemsaga.now()) < $4
on conflict (name, scope, holder) do update set until = excluded.until
returning 1`

// ReleaseHolds drops every hold of holder $1.
const ReleaseHolds = `delete from idemsaga.limit_holds where holder = $1`

// ExtendHolds pushes the holds of holder $1 to $2 ms from now.
const ExtendHolds = `update idemsaga.limit_holds set until = idemsaga.now() + $2::bigint * interval '1 millisecond' where holder = $1`

// ReserveRate reserves the next start under limit $1's rate, its calls
// spaced $2 microseconds apart: the limit's schedule moves on by one
// spacing from its next start or from now, whichever is later. It
// returns how many milliseconds from now the reserved start is (0 for
// at once). One row per limit, locked for the statement alone.
const ReserveRate = `insert into idemsaga.limit_rates as r (name, next_at) values ($1, idemsaga.now() + $2::bigint * interval '1 microsecond')
on conflict (name) do update set next_at = greatest(r.next_at, idemsaga.now()) + $2::bigint * interval '1 microsecond'
returning greatest(0, extract(epoch from (r.next_at - $2::bigint * interval '1 microsecond' - idemsaga.now())) * 1000)::float8`

// DeleteLapsedHolds drops a batch ($2) of holds that lapsed over $1 ms
// ago (their process died): a tenant that never calls again leaves none
// behind. A new hold drops the lapsed ones of its own scope itself.
const DeleteLapsedHolds = `delete from idemsaga.limit_holds where (name, scope, holder) in (
  select name, scope, holder from idemsaga.limit_holds
  where until < idemsaga.now() - $1 * interval '1 millisecond'
  limit $2
  for update skip locked)`

// ExtendLease pushes the lease of a dispatched step at attempt $4 to $5
// ms from now, if it ends sooner, without marking the attempt claimed:
// the attempt waits for a limit and has not started (a worker that dies
// meanwhile costs it nothing). It returns a row while the attempt is
// still the step's and dispatched.
const ExtendLease = `update idemsaga.steps set lease_until = greatest(lease_until, idemsaga.now() + $5::bigint * interval '1 millisecond')
where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched' and next_attempt_at is null
  and set_config('synchronous_commit', 'off', true) is not null
returning 1`
