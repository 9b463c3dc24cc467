package store

// The statements of callback steps: the events received, the wait, and
// the outcome a callback records under the step's key.

// MarkCallbackLate marks a pending callback late ($4 says why): its step
// was given up before it came.
const MarkCallbackLate = `update idemsaga.callbacks set outcome = 'late', detail = $4 where definition = $1 and step = $2 and event_id = $3 and outcome = 'pending'`

// SelectCallback reads an event already received for a step.
const SelectCallback = `select saga_id, body_hash, outcome, detail, received_at from idemsaga.callbacks
where definition = $1 and step = $2 and event_id = $3`

// InsertCallback records a new event; an event id taken meanwhile
// inserts nothing and returns no row.
const InsertCallback = `insert into idemsaga.callbacks (definition, step, event_id, saga_id, body_hash, failed, result, error, outcome, detail, applied_at)
values ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, $9, $10, case when $9 = 'applied' then idemsaga.now() end)
on conflict (definition, step, event_id) do nothing
returning received_at`

// CompleteWaiting records a callback's outcome under a waiting step's
// key ($2), fenced on the key still waiting (at attempt $3, or at an
// earlier one whose request was accepted after its lease was taken
// over). The saga's lock rules out a miss.
const CompleteWaiting = `with c as (
  update idemsaga.inbox set outcome = $4::text, result = $5::jsonb, error = $6::text
  where saga_id = $1 and step_key = $2 and attempt <= $3 and outcome = 'waiting'
  returning 1
)
select case when not exists (select from c) then idemsaga.invariant_broken('a waiting step''s key was not waiting at its attempt') end`

// WaitForCallback makes a callback step (or a child step, in phase $6)
// wait for its callback (its child) until its deadline ($4 milliseconds
// from now), fenced by the attempt and the saga's version ($5), which
// it bumps.
const WaitForCallback = `with st as (
  update idemsaga.steps set status = 'waiting', lease_until = idemsaga.now() + $4 * interval '1 millisecond',
    next_attempt_at = null, updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = $6 and attempt = $3 and status in ('dispatched', 'retrying')
  returning saga_id
), s as (
  update idemsaga.sagas set version = version + 1, updated_at = idemsaga.now()
  where id = $1 and version = $5 and exists (select from st)
  returning id
)
select case when not exists (select from s) then idemsaga.invariant_broken('a callback step could not begin to wait') end`

// FirstPendingCallback finds the first callback kept for a step
// before it waited.
const FirstPendingCallback = `select event_id, failed, result, coalesce(error, '') from idemsaga.callbacks
where saga_id = $1 and definition = $2 and step = $3 and outcome = 'pending'
order by received_at, event_id limit 1`

// ApplyPendingCallback marks the pending callback applied, and the
// step's other pending ones superseded.
const ApplyPendingCallback = `update idemsaga.callbacks set
  outcome = case when event_id = $3 then 'applied' else 'superseded' end,
  detail = case when event_id = $3 then $4 else 'another event completed the step first; this one changes nothing' end,
  applied_at = case when event_id = $3 then idemsaga.now() end
where definition = $1 and step = $2 and outcome = 'pending' and saga_id = $5`

// SelectCallbacks lists a saga's callbacks, for inspection.
const SelectCallbacks = `select step, event_id, outcome, failed, result, coalesce(error, ''), received_at, applied_at
from idemsaga.callbacks where saga_id = $1 order by received_at, event_id`

// CompleteSettled records a kept callback's outcome under a step key that
// SettleTombstone fenced in the same transaction.
const CompleteSettled = `update idemsaga.inbox set outcome = $3::text, result = $4::jsonb, error = $5::text
where saga_id = $1 and step_key = $2 and outcome = 'tombstone'`

// ReopenLateCallbacks makes the late callbacks of a callback step ($2)
// that an operator retries pending again, so that the first one applies
// when the step waits.
const ReopenLateCallbacks = `update idemsaga.callbacks set outcome = 'pending',
  detail = 'kept for the step retried by an operator; applied when it waits'
where saga_id = $1 and step = $2 and outcome = 'late'`
