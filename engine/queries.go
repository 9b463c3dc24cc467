package engine

const (
	sagaColumns = `id, definition, idem_key, state, version, input, results, coalesce(error, ''),
created_at, updated_at, finished_at`

	selectSagaByID       = `select ` + sagaColumns + ` from idemsaga.sagas where id = $1`
	selectSagaByIDLocked = selectSagaByID + ` for update`
	selectSagaByKeyFull  = `select ` + sagaColumns + ` from idemsaga.sagas where definition = $1 and idem_key = $2`
	selectSagasByKey     = `select ` + sagaColumns + ` from idemsaga.sagas where idem_key = $1 order by created_at`

	selectSteps = `select step, phase, step_index, key, status, attempt, lease_until, next_attempt_at,
coalesce(last_error, ''), result, created_at, updated_at
from idemsaga.steps where saga_id = $1 order by created_at, step_index, phase`

	// selectStep reads a step under its saga's lock, which every writer of
	// a step holds; the step's own writes are fenced by its attempt, so a
	// row lock here would only add a WAL record per step.
	selectStep = `select step_index, phase, status, attempt from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3`

	// transitionSaga is the one way a saga's state changes: conditional on
	// the state and version the caller read. It returns when the saga
	// started. A miss raises (migration 004),
	// classified from the saga's state as the statement found it: already
	// there (IDM02), moved elsewhere (IDM01), gone (IDM03).
	transitionSaga = `with u as (
  update idemsaga.sagas set
    state = $3,
    version = version + 1,
    updated_at = now(),
    finished_at = case when $4::bool then now() else finished_at end,
    error = coalesce($5::text, error),
    results = case when $6::text is null then results else results || jsonb_build_object($6::text, coalesce($7::jsonb, 'null'::jsonb)) end
  where id = $1 and state = $2 and version = $8
  returning version, created_at
)
select idemsaga.expect((select version from u) is not null, 'saga ' || $1::text, s.state, $3::text),
  (select created_at from u)
from (select 1) one left join idemsaga.sagas s on s.id = $1`

	// lockSagaAt locks a saga that must still be at the state and version
	// a command was written at, and returns when it started; a saga that
	// moved (or is gone) raises IDM01.
	lockSagaAt = `with s as (
  select created_at from idemsaga.sagas where id = $1 and state = $2 and version = $3 for update
)
select idemsaga.expect(count(*) > 0, 'saga ' || $1::text || ' at version ' || $3::text), min(created_at) from s`

	// succeedForward applies a forward step's success in one statement, as
	// the step's command foresaw the saga (guessInStep): the transition,
	// fenced by the state and version the command was written at ($2, $7),
	// which locks the saga first; the step's outcome, fenced by its attempt
	// ($8) and by its status: only a step still 'dispatched' is taken, as
	// its attempt then has no row in step_attempts to finish (an attempt
	// gets one when a retry is scheduled for it, or when it is replaced),
	// so no executor node is started for that table; a step at 'retrying'
	// misses, and the worker applies the success after reading the saga
	// (finishStep). (Before migration 004 every dispatch wrote a row; the
	// commands of that time carry no saga version, and applyInStep never
	// guesses for those. Guessing for them would need this CTE back.) Then attempt 1 of the next step with its command, as
	// dispatchStep ($9-$16). Any miss raises IDM01, with everything rolled
	// back. It returns when the saga started and the command's outbox id
	// (NULL when it wrote none). succeedLast is the same for the last step:
	// no next step, and no executor nodes started for one.
	succeedForward = succeedHead + `, st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select $1, $9, 'forward', $10, $11, 'dispatched', 1, now() + $12 * interval '1 millisecond', now()
  from f
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
), o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
  select $13, $14, $15, saga_id, clock_timestamp() + $16 * interval '1 millisecond' from st
  returning id
)
` + succeedTail + `, (select id from o)`
	succeedLast = succeedHead + `
` + succeedTail + `, null::bigint`
	succeedHead = `with u as (
  update idemsaga.sagas set
    state = $3,
    version = version + 1,
    updated_at = now(),
    finished_at = case when $4::bool then now() else finished_at end,
    results = results || jsonb_build_object($5::text, coalesce($6::jsonb, 'null'::jsonb))
  where id = $1 and state = $2 and version = $7
  returning created_at
), f as (
  update idemsaga.steps set
    status = 'succeeded', result = $6, last_error = null, lease_until = null, next_attempt_at = null, updated_at = now()
  where saga_id = $1 and step = $5 and phase = 'forward' and attempt = $8 and status = 'dispatched'
    and exists (select 1 from u)
  returning saga_id
)`
	succeedTail = `select idemsaga.expect((select count(*) from f) = 1, 'saga ' || $1::text || ' at version ' || $7::text || ' with step ' || $5 || ' at attempt ' || $8::text),
  (select created_at from u)`

	probeSaga = `select state, version from idemsaga.sagas where id = $1`

	// dispatchStep creates attempt 1 of a (saga, step, phase) and its
	// command in the outbox, in one statement; if the step exists already
	// its command is already out, and nothing is written. It returns the
	// command's outbox id, NULL when it wrote nothing. $10 is the outbox
	// hand-off in milliseconds (publish_after), NULL when the relay is to
	// publish the row.
	dispatchStep = `with st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  values ($1, $2, $3, $4, $5, 'dispatched', 1, now() + $6 * interval '1 millisecond', now())
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
), o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
  select $7, $8, $9, saga_id, clock_timestamp() + $10 * interval '1 millisecond' from st
  returning id
)
select (select id from o)`

	// startSaga inserts a saga and dispatches its first step, in one
	// statement, so that Start costs one round trip. A saga already under
	// (definition, key) makes it write nothing and return 0. It also
	// returns the command's outbox id; $12 is its hand-off, as in
	// dispatchStep. Last, when it inserted nothing, it returns what a
	// duplicate start needs to adjudicate (selectSagaByKey) from the saga
	// under the key, if the statement's snapshot sees one: one committed
	// before the statement began, the usual duplicate, answered in the
	// same round trip. A saga whose commit the insert waited for is not in
	// the snapshot: then the three are NULL and the caller reads it
	// (selectSagaByKey). The look is gated on the insert having written
	// nothing (a one-time filter: a new saga's start never reads the
	// index), so at SERIALIZABLE it reads, as the separate read did, only
	// for a duplicate. In a race no deployment should see, with the
	// retention cleaner deleting the snapshot's saga and another start
	// taking its key before this insert, the answer is the deleted saga:
	// the start as of its snapshot.
	startSaga = `with s as (
  insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state)
  values ($1, $2, $3, $4, $5, 'init')
  on conflict (definition, idem_key) do nothing
  returning id
), st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select id, $6, 'forward', 0, $7, 'dispatched', 1, now() + $8 * interval '1 millisecond', now() from s
  returning saga_id
), o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
  select $9, $10, $11, saga_id, clock_timestamp() + $12 * interval '1 millisecond' from st
  returning id
)
select (select count(*) from s), (select id from o), e.id, e.input_hash, e.state
from (select 1) one left join lateral (
  select id, input_hash, state from idemsaga.sagas
  where definition = $2 and idem_key = $3 and not exists (select 1 from s)
) e on true`

	// selectSagaByKey reads what a duplicate start needs to adjudicate,
	// when startSaga's snapshot did not see the saga under the key.
	selectSagaByKey = `select id, input_hash, state from idemsaga.sagas where definition = $1 and idem_key = $2`

	// insertCommand enqueues one command in the outbox; $5 is its
	// hand-off, as in dispatchStep.
	insertCommand = `insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
values ($1, $2, $3, $4, clock_timestamp() + $5 * interval '1 millisecond') returning id`

	// redispatchStep starts the next attempt, fenced by the attempt seen.
	// The attempt it ends goes into the timeline as 'lease expired',
	// unless it is there already (a retry was scheduled).
	redispatchStep = `with cur as (
  select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at
  from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('dispatched', 'retrying')
), r as (
  update idemsaga.steps set
    status = 'dispatched', attempt = attempt + 1,
    lease_until = now() + $5 * interval '1 millisecond',
    next_attempt_at = null, dispatched_at = now(), updated_at = now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('dispatched', 'retrying')
  returning attempt
), old as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome)
  select saga_id, step, phase, attempt, dispatched_at, now(), 'lease expired' from cur where exists (select 1 from r)
  on conflict (saga_id, step, phase, attempt) do update set
    finished_at = coalesce(idemsaga.step_attempts.finished_at, now()),
    outcome = coalesce(idemsaga.step_attempts.outcome, 'lease expired')
)
select attempt from r`

	// finishStep records a step's outcome, fenced by the attempt (a miss
	// raises IDM01). The attempt's timeline row, if it has one (a retry was
	// scheduled, then a redelivery succeeded), takes the outcome $8; on the
	// happy path there is none, and the step row is the timeline.
	finishStep = `with f as (
  update idemsaga.steps set
    status = $5, result = $6, last_error = $7, lease_until = null, next_attempt_at = null, updated_at = now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status in ('dispatched', 'retrying')
  returning saga_id, step, phase, attempt
), a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then $8 else x.outcome end, error = coalesce($7, x.error)
  from f where x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
)
select idemsaga.expect(count(*) > 0, 'step ' || $2 || ' (' || $3 || ') of saga ' || $1::text) from f`

	// settleLockTimeout bounds the wait on a step worker still holding the
	// key uncommitted: the engine retries the decision later rather than
	// block behind a stalled process.
	settleLockTimeout = `select set_config('lock_timeout', '100ms', true)`

	// settleTombstone fences a step the engine gives up on: once it
	// commits, no delivery of the step's command can take effect.
	settleTombstone = `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
values ($1, $2, $3, $4, 0, 'tombstone')
on conflict (saga_id, step_key) do nothing`

	// settleRead reads what the inbox holds for a step being settled. Its
	// result is the inbox row's own: a success whose result went into the
	// step's row alone (a success applied in its step, as its command
	// foresaw) also made the step succeeded, and a succeeded step is never
	// settled.
	settleRead = `select outcome, result from idemsaga.inbox where saga_id = $1 and step_key = $2`

	// scheduleRetry puts a step in its retry wait and its attempt into
	// the timeline as 'retry'.
	scheduleRetry = `with f as (
  update idemsaga.steps set
    status = 'retrying', last_error = $5, lease_until = null,
    next_attempt_at = now() + $6 * interval '1 millisecond', updated_at = now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'
  returning saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at
), a as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, attempt, dispatched_at, now(), 'retry', $5 from f
  on conflict (saga_id, step, phase, attempt) do update set finished_at = now(), outcome = 'retry', error = excluded.error
)
select idemsaga.expect(count(*) > 0, 'step ' || $2 || ' (' || $3 || ') of saga ' || $1::text) from f`

	// The reaper's two hot queries, each matching its partial index. They
	// only find candidates; each is then re-checked under the saga's lock.
	// dueRetries and expiredLeases pick the reaper's work. A step whose
	// saga is gone (deleted by hand: no foreign key deletes its steps,
	// migration 009) is left out, so such rows cannot fill every batch;
	// reconcile reports them.
	dueRetries = `select st.saga_id, st.step, st.phase from idemsaga.steps st
where st.status = 'retrying' and st.next_attempt_at <= now()
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id)
order by st.next_attempt_at limit $1`

	expiredLeases = `select st.saga_id, st.step, st.phase from idemsaga.steps st
where st.status = 'dispatched' and st.lease_until < now()
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id)
order by st.lease_until limit $1`

	// lockSagaOfStep locks the saga of a step first (the orchestrator takes the same
	// order: saga, then step, so the two never deadlock), skipping a saga
	// another process holds.
	lockSagaOfStep = `select id from idemsaga.sagas where id = $1 for update skip locked`

	selectStepForReap = `select step_index, phase, status, attempt,
(status = 'retrying' and next_attempt_at <= now()) as due,
(status = 'dispatched' and lease_until < now()) as expired
from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 for update`
)

// selectAttempts is a saga's timeline: the attempts recorded in
// step_attempts, and each step's current attempt from its own row when
// step_attempts has none for it (the happy path).
const selectAttempts = `select step, phase, attempt, dispatched_at, finished_at, outcome, error from (
  select step, phase, attempt, dispatched_at, finished_at, coalesce(outcome, '') as outcome, coalesce(error, '') as error
  from idemsaga.step_attempts where saga_id = $1
  union all
  select st.step, st.phase, st.attempt, coalesce(st.dispatched_at, st.created_at),
    case when st.status in ('succeeded', 'failed') then st.updated_at end,
    case when st.status in ('succeeded', 'failed') then st.status else '' end,
    case when st.status = 'failed' then coalesce(st.last_error, '') else '' end
  from idemsaga.steps st
  where st.saga_id = $1 and not exists (
    select 1 from idemsaga.step_attempts x
    where x.saga_id = st.saga_id and x.step = st.step and x.phase = st.phase and x.attempt = st.attempt)
) t
order by dispatched_at, attempt`

// listSagas filters by definition ($1), state ($2), age ($3 seconds) and
// stuckness ($4, with margin $5 seconds); empty or zero filters match all.
const listSagas = `select ` + sagaColumns + ` from idemsaga.sagas s
where ($1 = '' or s.definition = $1)
  and ($2 = '' or s.state = $2)
  and ($3::float8 = 0 or s.created_at < now() - $3::float8 * interval '1 second')
  and (not $4 or (s.finished_at is null and not exists (
        select 1 from idemsaga.steps st where st.saga_id = s.id and (
          (st.status = 'dispatched' and st.lease_until >= now() - $5::float8 * interval '1 second')
          or (st.status = 'retrying' and st.next_attempt_at >= now() - $5::float8 * interval '1 second')))))
order by s.created_at desc
limit $6`

// retryFailedStep re-opens a failed step for an operator's retry; the
// failed attempt goes into the timeline.
const retryFailedStep = `with cur as (
  select saga_id, step, phase, attempt, coalesce(dispatched_at, created_at) as dispatched_at, updated_at, last_error
  from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'failed'
), r as (
  update idemsaga.steps set
    status = 'dispatched', attempt = attempt + 1, last_error = null,
    lease_until = now() + $5 * interval '1 millisecond', next_attempt_at = null,
    dispatched_at = now(), updated_at = now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'failed'
  returning attempt
), old as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, attempt, dispatched_at, updated_at, 'failed', last_error from cur where exists (select 1 from r)
  on conflict (saga_id, step, phase, attempt) do nothing
)
select attempt from r`
