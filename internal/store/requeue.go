package store

import "fmt"

// The statements of the requeue of commands the broker lost.

// SelectStepForReap reads a step under its saga's lock, and what the
// reaper may do with it. For an expired lease, claimed tells whether a
// worker claimed the attempt and restarted its lease then (claimed_attempt:
// a command that reached it late or again, or the reaper's own mark), and
// running whether an attempt holds the key now: its lock is held ($4 is
// the key's lock id, looked up in pg_locks rather than tried, which would
// make the key look busy to another reaper), or the inbox has the attempt
// started (an external call). An attempt whose outcome the inbox holds is
// neither, but answered: its reply (or the move it missed) is on its way.
// queued_ms is how long ago the attempt was dispatched; verifying says the
// attempt asks the step's Verify alone (Resend.Verify).
var SelectStepForReap = fmt.Sprintf(`select step_index, phase::text, status::text, attempt, possibly_done,
(status = 'retrying' and next_attempt_at <= idemsaga.now()) as due,
(status = 'dispatched' and lease_until < idemsaga.now() and next_attempt_at is null) as expired,
(status = 'dispatched' and next_attempt_at is not null and next_attempt_at <= idemsaga.now()) as resend,
exists (select 1 from idemsaga.sagas s where s.id = $1 and not (`+NotPaused+`)) as paused,
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
exists (select 1 from idemsaga.inbox i where i.saga_id = st.saga_id and i.step_key = st.key and i.attempt >= st.attempt and i.outcome in ('succeeded', 'failed')) as ended,
(extract(epoch from idemsaga.now() - coalesce(dispatched_at, created_at)) * 1000)::bigint as queued_ms,
coalesce(verify_attempt = attempt, false) as verifying
from idemsaga.steps st where saga_id = $1 and step = $2 and phase = $3`, LockClass)

// MarkClaimed marks an attempt found running without its worker's mark as
// claimed, with a lease from now ($5 ms): the lease of an attempt runs from
// its claim, and this is the latest its claim can have been.
const MarkClaimed = `update idemsaga.steps set claimed_attempt = attempt, lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', updated_at = idemsaga.now()
where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'`

// RequeueStep keeps a dispatched step whose command no worker claimed at
// its attempt ($4), with a new dispatch timer ($5 ms), and, when $6 is not
// null, writes its command again ($6-$9: subject, message id, payload,
// hand-off, and $10 its headers). $11 says the command was found lost: the
// second time at one attempt, the attempt is marked claimed, and its next
// expiry is a takeover. The saga's version stays: the command is the one
// still on its way. It returns whether the step was there and
// the command's outbox id.
var RequeueStep = `with r as (
  update idemsaga.steps set lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', updated_at = idemsaga.now(),
    claimed_attempt = case when $11 and resent_attempt = attempt then attempt else claimed_attempt end,
    resent_attempt = case when $11 then attempt else resent_attempt end
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched' and next_attempt_at is null
  returning saga_id
), o as (
  ` + outboxInsert(`select $6::text, $7, $8, saga_id, clock_timestamp() + $9 * interval '1 millisecond', $10::jsonb from r where $6::text is not null`) + `
  returning id
)
select exists (select 1 from r), (select id from o)`
