package store

import (
	"fmt"
	"strings"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/internal/pguuid"
)

// The statements of sagas and their steps: starting, reading and moving them.

// SagaColumns are a saga's columns, in the order the engine scans them.
const SagaColumns = `id, definition, idem_key, state::text, version, input, results, coalesce(error, ''),
created_at, updated_at, finished_at, definition_version, skipped, parent_id, coalesce(parent_step, '')`

// SelectSagaByIDLocked takes the lock every writer of a saga or of its
// steps holds. FOR NO KEY UPDATE, not FOR UPDATE: it does not block the
// inbox's and the steps' foreign-key checks (FOR KEY SHARE), so a step's
// claim never waits for the orchestrator.
const SelectSagaByIDLocked = SelectSagaByID + ` for no key update`

// SelectSagaByID reads saga $1.
const SelectSagaByID = `select ` + SagaColumns + ` from idemsaga.sagas where id = $1`

// SelectSagaByKeyFull reads the saga of definition $1 under key $2.
const SelectSagaByKeyFull = `select ` + SagaColumns + ` from idemsaga.sagas where definition = $1 and idem_key = $2`

// SelectSagasByKey reads the sagas of every definition under key $1.
const SelectSagasByKey = `select ` + SagaColumns + ` from idemsaga.sagas
where definition = any(array(select distinct name from idemsaga.definitions)) and idem_key = $1 order by created_at`

// Doubt holds for a step st, with its key's inbox row i, that may have
// taken effect: an attempt's outcome was unknown, as the step's row or
// the key's row says, and the step's Verify has not answered since that
// the key took no effect.
const Doubt = `(coalesce(i.unknown, false) or st.possibly_done and not coalesce(i.verified, false))`

// SelectSteps reads a saga's steps; a step is possibly done when an
// attempt's outcome was unknown, as the step's row or its key's inbox
// row says (Doubt).
const SelectSteps = `select st.step, st.phase::text, st.step_index, st.key, st.status::text, st.attempt,
  ` + Doubt + `,
  st.lease_until, st.next_attempt_at, coalesce(st.last_error, ''), st.result, st.created_at, st.updated_at
from idemsaga.steps st
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.saga_id = $1 order by st.created_at, st.step_index, st.phase`

// SelectStep reads a step under its saga's lock, which every writer
// of a step holds.
const SelectStep = `select step_index, phase::text, status::text, attempt, possibly_done from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3`

// StartSaga inserts a saga and dispatches its first step, in one
// statement, so that Start costs one round trip. A saga already under
// (definition, key) makes it write nothing and return 0. It also
// returns the command's outbox id. Last, when it inserted nothing, it
// returns what a duplicate start needs to adjudicate from the saga
// under the key, if the statement's snapshot sees one: one committed
// before the statement began, the usual duplicate, answered in the same
// round trip. A saga whose commit the insert waited for is not in the
// snapshot: then the three are NULL and the caller reads it
// (SelectSagaByKey). The look is gated on the insert having written
// nothing, so a new saga's start never reads the index.
//
// $1-$5 are the saga's ID, definition, key, input hash and input; $6-$8
// its first step's name, key and lease in milliseconds; $9 the
// definition's deadline in milliseconds, NULL for none; $10 the version
// of the definition the saga runs; $11 the start's trace context, for
// the saga and its first command's headers, NULL when the start is not
// traced; $12, when not NULL, an advisory lock (package startlock)
// tried first, without waiting: not got, the statement writes nothing
// and its last column is false. $13-$16 are the first command's
// subject, message ID, payload and hand-off in milliseconds
// (publish_after), NULL when the relay is to publish it.
var StartSaga = StartStatement(false, false, true)

// StartStatement returns the start statement (StartSaga's parameters and
// answer) for a key that is a submit token (StartSagaWithToken) or not;
// with the lock ($12) tried or not (then $12 is NULL); and with the first
// command or, for a first step run in the start's transaction
// (attempt.Runner.Carry), without it and without the step's row, which
// the attempt writes (FirstStep): $6-$8 and $13-$16 are then not taken,
// and $9-$12 become $6-$9. A part a start
// lacks is left out of its statement, as in a Record's: the executor
// would open its table and indexes for nothing.
func StartStatement(token, locked, command bool) string {
	return startStatements[startShape{token, locked, command}]
}

type startShape struct{ token, locked, command bool }

var startStatements = func() map[startShape]string {
	all := map[startShape]string{}
	for bits := range 8 {
		sh := startShape{bits&1 != 0, bits&2 != 0, bits&4 != 0}
		all[sh] = sh.text()
	}
	return all
}()

func (sh startShape) text() string {
	var ctes []string
	from, gate, got := "", "", "($12::bigint is null or true)"
	if sh.locked {
		ctes = append(ctes, `l as (
  select pg_try_advisory_xact_lock($12::bigint) as got
)`)
		from, gate, got = "\n  from l where l.got", " and (select got from l)", "(select got from l)"
	}
	if sh.token {
		// The token is consumed first, and the saga inserted only then.
		ctes = append(ctes, `t as (
  update idemsaga.submit_tokens set saga_id = $1, consumed_at = idemsaga.now()
  where token = $3 and definition = $2 and consumed_at is null and expires_at > idemsaga.now()`+gate+`
  returning token
)`)
		from = "\n  from t"
	}
	ctes = append(ctes, `s as (
  insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state, deadline_at, definition_version, trace_context)
  select $1::uuid, $2::text, $3::text, $4::bytea, $5::jsonb, 'init', idemsaga.now() + $9::bigint * interval '1 millisecond', $10::int, $11::jsonb`+from+`
  on conflict (definition, idem_key) do nothing
  returning id
)`)
	if sh.command {
		// A carried start leaves its first step's row to the attempt
		// (FirstStep), which writes it once, as it ends.
		ctes = append(ctes, `st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select id, $6, 'forward', 0, $7, 'dispatched', 1, idemsaga.now() + $8 * interval '1 millisecond', idemsaga.now() from s
  returning saga_id
)`)
	}
	id := "null::bigint"
	if sh.command {
		ctes = append(ctes, `o as (
  `+outboxInsert(`select $13::text, $14::text, $15::bytea, saga_id, clock_timestamp() + $16::bigint * interval '1 millisecond', $11::jsonb from st`)+`
  returning id
)`)
		id = "(select id from o)"
	}
	text := "with " + strings.Join(ctes, ", ") + `
select (select count(*) from s), ` + id + `, e.id, e.input_hash, e.state::text, ` + got + `
from (select 1) one left join lateral (
  select id, input_hash, state from idemsaga.sagas
  where definition = $2 and idem_key = $3 and not exists (select 1 from s)
) e on true`
	if !sh.command {
		// Without the first step's row, $6-$8 are not taken: the rest
		// move down (a parameter no statement uses has no type).
		text = strings.NewReplacer("$9", "$6", "$10", "$7", "$11", "$8", "$12", "$9").Replace(text)
	}
	return text
}

// FirstStep is the row of a saga's first step, dispatched at attempt 1,
// that a carried start leaves out (StartStatement without its command):
// the attempt run in the start's transaction writes it once it ends, in
// its final form with a success's move (Move.First), or as the start
// would have (QueueFirstStep) before any other write of its.
type FirstStep struct {
	Saga        uuid.UUID
	Step        string
	Key         uuid.UUID
	LeaseMillis int64
}

// insertFirstStep writes a FirstStep's row where its saga is and the row
// is not ($1-$4: saga, step, key, lease in milliseconds).
const insertFirstStep = `insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
select s.id, $2, 'forward', 0, $3, 'dispatched', 1, idemsaga.now() + $4 * interval '1 millisecond', s.created_at
from idemsaga.sagas s where s.id = $1
on conflict (saga_id, step, phase) do nothing`

// QueueFirstStep queues the write of f's row on tx: before any write of
// the carried attempt other than its success's move, so that the outcome
// it records, or a transaction its handler ended, leaves the step's row
// as a start alone would have.
func QueueFirstStep(tx *Tx, f FirstStep) {
	tx.Exec(insertFirstStep, nil, pguuid.Of(f.Saga), f.Step, pguuid.Of(f.Key), f.LeaseMillis)
}

// SelectSagaByKey reads what a duplicate start needs to adjudicate,
// when StartSaga's snapshot did not see the saga under the key.
const SelectSagaByKey = `select id, input_hash, state::text from idemsaga.sagas where definition = $1 and idem_key = $2`

// redispatchStep starts the next attempt of a step, fenced by the
// attempt seen ($4), bumps the saga's version ($6, seen under its lock)
// and writes the attempt's command ($7-$11: subject, message id,
// payload, hand-off, headers); $12 says the new attempt asks the step's
// Verify alone. The attempt it ends goes into the timeline as
// 'lease expired', unless it is there already (a retry was scheduled).
// It returns the new attempt and the command's outbox id.
var redispatchStep = `with cur as (
  select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at
  from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('dispatched', 'retrying')
), r as (
  update idemsaga.steps set
    status = 'dispatched', attempt = attempt + 1,
    lease_until = idemsaga.now() + $5 * interval '1 millisecond',
    next_attempt_at = null, dispatched_at = idemsaga.now(), updated_at = idemsaga.now(),
    verify_attempt = case when $12::bool then attempt + 1 else verify_attempt end
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('dispatched', 'retrying')
  returning saga_id, attempt
), old as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome)
  select saga_id, step, phase, attempt, dispatched_at, idemsaga.now(), 'lease expired' from cur where exists (select 1 from r)
  on conflict (saga_id, step, phase, attempt) do update set
    finished_at = coalesce(idemsaga.step_attempts.finished_at, idemsaga.now()),
    outcome = coalesce(idemsaga.step_attempts.outcome, 'lease expired')
), v as (
  update idemsaga.sagas set version = version + 1, updated_at = idemsaga.now()
  where id = $1 and version = $6 and exists (select 1 from r)
  returning id
), o as (
  ` + outboxInsert(`select $7, $8, $9, id, clock_timestamp() + $10 * interval '1 millisecond', $11::jsonb from v`) + `
  returning id
)
select (select attempt from r), (select id from o),
  case when exists (select 1 from r) and not exists (select 1 from v) then idemsaga.invariant_broken('a redispatch of step ' || $2 || ' (' || $3 || ') of saga ' || $1::text || ' found its saga moved under its lock') end`

// ScheduleRetry puts a step in its retry wait, its attempt into the
// timeline as $8 ('retry', or 'unknown' for an external call that may
// have taken effect, which also makes the step possibly done), and
// bumps the saga's version ($9, seen under its lock). A miss is a bug:
// the step was read dispatched under the saga's lock.
const ScheduleRetry = `with f as (
  update idemsaga.steps set
    status = 'retrying', last_error = $5, lease_until = null,
    possibly_done = possibly_done or $7::text = 'unknown',
    next_attempt_at = idemsaga.now() + $6 * interval '1 millisecond', updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'
  returning saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at
), a as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, attempt, dispatched_at, idemsaga.now(), $7, $5 from f
  on conflict (saga_id, step, phase, attempt) do update set finished_at = idemsaga.now(), outcome = excluded.outcome, error = excluded.error
), v as (
  update idemsaga.sagas set version = version + 1, updated_at = idemsaga.now()
  where id = $1 and version = $8 and exists (select 1 from f)
  returning id
)
select case when not exists (select 1 from f) or not exists (select 1 from v)
  then idemsaga.invariant_broken('the retry of step ' || $2 || ' (' || $3 || ') of saga ' || $1::text || ' at attempt ' || $4::text || ' missed its row under the saga''s lock') end`

// MarkAttemptUnknown records that a step's last attempt, given up
// after it, had an unknown outcome.
const MarkAttemptUnknown = `insert into idemsaga.step_attempts as x (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at), idemsaga.now(), 'unknown', $5
from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4
on conflict (saga_id, step, phase, attempt) do update set outcome = 'unknown', error = excluded.error, finished_at = excluded.finished_at
where x.outcome is null or x.outcome = 'retry'`

// NoteVerifiedAttempt records on a step's attempt $4 what its Verify
// found ($5): the call's outcome was unknown and the key had taken
// effect. It goes before the record of that success, in its transaction;
// the move that applies the success, there or later from a reply, keeps
// the note.
const NoteVerifiedAttempt = `insert into idemsaga.step_attempts as x (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at), idemsaga.now(), 'succeeded', $5
from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('succeeded', 'dispatched', 'waiting')
on conflict (saga_id, step, phase, attempt) do update set error = excluded.error`

// DueRetries and ExpiredLeases, the reaper's two hot queries, each matching
// its partial index, find the work of the reaper (candidates only, each
// re-checked under its saga's lock), for the
// definition versions this process runs ($2, "name@version"): another
// definition's or version's steps are left to the workers that have
// its code. A paused saga's steps are neither (NotPaused), and
// a step to send again after a resume (ResendDue) is not an expired
// lease.
const DueRetries = `select st.saga_id, st.step, st.phase::text from idemsaga.steps st
where st.status = 'retrying' and st.next_attempt_at <= idemsaga.now()
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id and s.definition || '@' || s.definition_version = any($2) and ` + NotPaused + `)
order by st.next_attempt_at limit $1`

// ExpiredLeases finds dispatched steps whose lease ran out.
const ExpiredLeases = `select st.saga_id, st.step, st.phase::text from idemsaga.steps st
where st.status = 'dispatched' and st.lease_until < idemsaga.now() and st.next_attempt_at is null
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id and s.definition || '@' || s.definition_version = any($2) and ` + NotPaused + `)
order by st.lease_until limit $1`

// ExpiredWaits finds callback steps whose wait ran out.
const ExpiredWaits = `select st.saga_id, st.step, st.phase::text from idemsaga.steps st
where st.status = 'waiting' and st.lease_until < idemsaga.now()
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id and s.definition || '@' || s.definition_version = any($2) and ` + NotPaused + `)
order by st.lease_until limit $1`

// LockSagaOfStep locks the saga of a step first (every writer takes
// the same order: saga, then step), skipping a saga another process
// holds.
const LockSagaOfStep = `select ` + SagaColumns + ` from idemsaga.sagas where id = $1 for no key update skip locked`

// SettleRead reads what the inbox holds for a step being settled, once
// SettleTombstone fenced it.
const SettleRead = `select outcome::text, unknown, verified, result from idemsaga.inbox where saga_id = $1 and step_key = $2`

// SettleTombstone fences a step the engine gives up, if no attempt holds
// its key ($5, its advisory lock, tried without waiting): a tombstone, so
// once the transaction commits no delivery of the step's command can take
// effect. An external call still marked started, or a callback step's
// request still waiting for its callback, becomes unknown. It returns
// whether the key was free.
var SettleTombstone = fmt.Sprintf(`with l as (
  select pg_try_advisory_xact_lock(%d, $5) as got
), t as (
  insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome)
  select $1, $2, $3, $4::text, 0, 'tombstone' from l where l.got
  on conflict (saga_id, step_key) do update set outcome = 'tombstone', unknown = x.unknown or x.outcome in ('started', 'waiting'),
    verified = x.verified and x.outcome not in ('started', 'waiting')
  where x.outcome in ('started', 'retry', 'waiting')
)
select got from l`, LockClass)

// SettleTombstoneForCancel is SettleTombstone that leaves alone the claim
// of an external attempt whose lease still runs: the call may be in
// flight, and an undo now could reach the other system before it.
var SettleTombstoneForCancel = fmt.Sprintf(`with l as (
  select pg_try_advisory_xact_lock(%d, $5) as got
), t as (
  insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome)
  select $1, $2, $3, $4::text, 0, 'tombstone' from l where l.got
  on conflict (saga_id, step_key) do update set outcome = 'tombstone', unknown = x.unknown or x.outcome in ('started', 'waiting'),
    verified = x.verified and x.outcome not in ('started', 'waiting')
  where x.outcome in ('retry', 'waiting') or (x.outcome = 'started' and not exists (
    select 1 from idemsaga.steps st where st.saga_id = $1 and st.key = $2 and st.status = 'dispatched' and st.lease_until > idemsaga.now()))
)
select got from l`, LockClass)

// SelectAttempts is a saga's timeline: the attempts recorded in
// step_attempts, and each step's current attempt from its own row when
// step_attempts has none for it (the happy path).
const SelectAttempts = `select step, phase, attempt, dispatched_at, finished_at, outcome, error from (
  select x.step, x.phase::text, x.attempt, x.dispatched_at, x.finished_at, coalesce(x.outcome::text, '') as outcome, coalesce(x.error, '') as error, st.step_index
  from idemsaga.step_attempts x join idemsaga.steps st using (saga_id, step, phase) where x.saga_id = $1
  union all
  select st.step, st.phase::text, st.attempt, coalesce(st.dispatched_at, st.created_at),
    case when st.status in ('succeeded', 'failed') then st.updated_at end,
    case when st.status in ('succeeded', 'failed') then st.status::text else '' end,
    case when st.status = 'failed' then coalesce(st.last_error, '') else '' end,
    st.step_index
  from idemsaga.steps st
  where st.saga_id = $1 and not exists (
    select 1 from idemsaga.step_attempts x
    where x.saga_id = st.saga_id and x.step = st.step and x.phase = st.phase and x.attempt = st.attempt)
) t
order by dispatched_at, finished_at nulls last, step_index, attempt`

// ListSagas filters by definition ($1), state ($2), age ($3 seconds),
// stuckness ($4, with margin $5 seconds), parked commands ($9),
// definition version ($10), key ($11), creation time ($12 from, $13
// before), pause ($14) and a step waiting ($15); empty or zero filters
// match all. Newest first, after the cursor ($7, $8).
const ListSagas = `select ` + SagaColumns + ` from idemsaga.sagas s` + listSagasWhere + listNewestFirst

// ListSagasOldestFirst is ListSagas oldest first.
const ListSagasOldestFirst = `select ` + SagaColumns + ` from idemsaga.sagas s` + listSagasWhere + listOldestFirst

// ListSagasByKey is ListSagas for a key ($11 not empty): it reads the
// sagas of that key through the (definition, idem_key) index, one probe
// per definition recorded, rather than every saga.
const ListSagasByKey = `select ` + SagaColumns + ` from (select * from idemsaga.sagas
  where definition = any(array(select distinct name from idemsaga.definitions)) and idem_key = $11) s` + listSagasWhere + listNewestFirst

// ListSagasByKeyOldestFirst is ListSagasByKey oldest first.
const ListSagasByKeyOldestFirst = `select ` + SagaColumns + ` from (select * from idemsaga.sagas
  where definition = any(array(select distinct name from idemsaga.definitions)) and idem_key = $11) s` + listSagasWhere + listOldestFirst

const listNewestFirst = `
  and ($7::timestamptz is null or (s.created_at, s.id) < ($7, $8))
order by s.created_at desc, s.id desc
limit $6`

const listOldestFirst = `
  and ($7::timestamptz is null or (s.created_at, s.id) > ($7, $8))
order by s.created_at, s.id
limit $6`

const listSagasWhere = `
where ($1 = '' or s.definition = $1)
  and ($2 = '' or s.state::text = $2)
  and ($3::float8 = 0 or s.created_at < idemsaga.now() - $3::float8 * interval '1 second')
  and (not $4 or (s.finished_at is null and ` + NotPaused + ` and not exists (
        select 1 from idemsaga.steps st where st.saga_id = s.id and (
          (st.status = 'dispatched' and st.lease_until >= idemsaga.now() - $5::float8 * interval '1 second')
          or (st.status = 'retrying' and st.next_attempt_at >= idemsaga.now() - $5::float8 * interval '1 second')
          or (st.status = 'waiting' and st.lease_until >= idemsaga.now() - $5::float8 * interval '1 second')))))
  and (not $9 or exists (select 1 from idemsaga.dead_letters d where d.saga_id = s.id))
  and ($10 = 0 or s.definition_version = $10)
  and ($11 = '' or s.idem_key = $11)
  and ($12::timestamptz is null or s.created_at >= $12)
  and ($13::timestamptz is null or s.created_at < $13)
  and (not $14 or (s.finished_at is null and not (` + NotPaused + `)))
  and (not $15 or (s.finished_at is null and exists (select 1 from idemsaga.steps st where st.saga_id = s.id and st.status = 'waiting')))`

// CountSagas counts sagas by state, of one definition or all.
const CountSagas = `select state::text, count(*) from idemsaga.sagas where ($1 = '' or definition = $1) group by state`

// RetryFailedStep re-opens a failed step for an operator's retry; the
// failed attempt goes into the timeline.
const RetryFailedStep = `with cur as (
  select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at, updated_at, last_error
  from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'failed'
), r as (
  update idemsaga.steps set
    status = 'dispatched', attempt = attempt + 1, last_error = null,
    lease_until = idemsaga.now() + $5 * interval '1 millisecond', next_attempt_at = null,
    dispatched_at = idemsaga.now(), updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'failed'
  returning attempt
), old as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, attempt, dispatched_at, updated_at, 'failed', last_error from cur where exists (select 1 from r)
  on conflict (saga_id, step, phase, attempt) do nothing
)
select attempt from r`

// SelectStepInFlight reads a running saga's step in flight (one, as
// reconcile checks; of a parallel group's branches, one that waits out a
// retry's backoff first), under its saga's lock.
const SelectStepInFlight = `select step, phase::text, step_index, status::text, attempt, lease_until from idemsaga.steps
where saga_id = $1 and status in ('dispatched', 'retrying', 'waiting') order by status = 'retrying' desc, updated_at desc limit 1`

// SelectNamedStepInFlight is SelectStepInFlight for a repair that names
// its step ($2): of a parallel group's branches in flight, that one.
const SelectNamedStepInFlight = `select step, phase::text, step_index, status::text, attempt, lease_until from idemsaga.steps
where saga_id = $1 and status in ('dispatched', 'retrying', 'waiting') order by step = $2 desc, updated_at desc limit 1`

// SkipAttempt ends a step's attempt $4 for an operator's skip (into the
// timeline as it ended: failed, retry, or cut short) and opens the skip's
// own attempt, whose success the skip's move records with the note $5.
// It returns the skip's attempt.
const SkipAttempt = `with cur as (
  select saga_id, step, phase, attempt, status, coalesce(dispatched_at, created_at) as dispatched_at, updated_at, last_error
  from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('failed', 'retrying', 'dispatched', 'waiting')
), r as (
  update idemsaga.steps set
    status = 'dispatched', attempt = attempt + 1, lease_until = idemsaga.now(), next_attempt_at = null,
    dispatched_at = idemsaga.now(), updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('failed', 'retrying', 'dispatched', 'waiting')
  returning attempt
), old as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, attempt, dispatched_at,
    case when status = 'failed' then updated_at else idemsaga.now() end,
    case status when 'failed' then 'failed' when 'retrying' then 'retry' when 'waiting' then 'unknown' else 'lease expired' end,
    case when status = 'failed' then last_error else 'ended by an operator''s skip' end
  from cur where exists (select 1 from r)
  on conflict (saga_id, step, phase, attempt) do update set
    finished_at = coalesce(idemsaga.step_attempts.finished_at, idemsaga.now()),
    outcome = coalesce(idemsaga.step_attempts.outcome, excluded.outcome)
), skip as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, error)
  select $1, $2, $3, attempt, idemsaga.now(), $5 from r
)
select attempt from r`

// SelectRepairs is a saga's repairs, oldest first.
const SelectRepairs = `select operation, request_key, reason, requested_by, coalesce(step, ''), coalesce(phase::text, ''), state_after::text, created_at
from idemsaga.repairs where saga_id = $1 order by created_at, request_key`
