-- The engine's durable state, in schema idemsaga. PostgreSQL is the source
-- of truth for every saga; NATS is only transport: whatever the broker
-- loses is driven again from these tables.
--
-- Rules on values are domains rather than table CHECKs. PostgreSQL 15
-- rebuilds a table's CHECK constraints from their stored text in every
-- statement that writes the table (measured here: an UPDATE by primary key
-- of idemsaga.steps with two CHECKs cost 31-40 us of backend CPU against
-- 15-17 us without); a domain's check is built once per session and only
-- evaluated per row. The rules hold either way.
--
-- The foreign keys from steps, attempts and the inbox to their saga stay,
-- although their checks are PostgreSQL's largest single cost on a saga's
-- happy path: dropping them showed no throughput difference beyond the
-- noise (bench/JOURNAL.md). The inbox's also keeps a claim from landing
-- for a saga that retention is deleting.

-- idemsaga.now() is the engine's clock: every lease, retry time and
-- retention cutoff is measured by it, on the database, never on a
-- worker's clock. It is pg_catalog.now(), inlined by the planner; the
-- test kit (package sagatest) replaces it in its own test databases with
-- a clock it can move forward, so that backoffs, leases and retention
-- can be skipped in tests.
create function idemsaga.now() returns timestamptz
    language sql stable parallel safe
    return pg_catalog.now();

create domain idemsaga.phase as text
    constraint phase_known check (value in ('forward', 'compensate'));

-- A saga's state: a built-in one (init, compensating, compensated, failed,
-- parked) or the state a step of its definition reaches, 1 to 64
-- characters as saga.New allows. Its characters are not matched here: a
-- regular expression is a measurable share of PostgreSQL's work per saga
-- (bench/JOURNAL.md), and saga.New already checked them.
create domain idemsaga.state_name as text
    constraint state_name_valid check (length(value) between 1 and 64);

-- A definition's version (saga.WithVersion), from 1.
create domain idemsaga.definition_version as int
    constraint definition_version_valid check (value >= 1);

-- waiting: a callback step's request was accepted; it waits for the
-- other system's callback until lease_until, the wait's deadline.
create domain idemsaga.step_status as text
    constraint step_status_known check (value in ('dispatched', 'retrying', 'waiting', 'succeeded', 'failed'));

-- What the inbox holds for a step key. Final: succeeded, failed (a
-- permanent failure, or attempts exhausted), tombstone (given up or
-- fenced by a compensation: no later delivery may take effect). Not final:
-- retry (the attempt in "attempt" ended without effect, or, for an
-- external step, with an unknown outcome; a later attempt may start, that
-- one never runs again); for external steps, started (that attempt
-- claimed its call and recorded no outcome yet: it is calling, or its
-- process died); for callback steps, waiting (the attempt's request was
-- accepted; its callback decides).
create domain idemsaga.inbox_outcome as text
    constraint inbox_outcome_known check (value in ('started', 'retry', 'waiting', 'succeeded', 'failed', 'tombstone'));

create domain idemsaga.attempt_outcome as text
    constraint attempt_outcome_known check (value in ('succeeded', 'failed', 'retry', 'unknown', 'lease expired'));

-- One row per saga. (definition, idem_key) is unique: the database, not
-- application code, adjudicates concurrent starts of one business intent.
-- Every change of a saga or of one of its steps is a conditional update on
-- (state, version) that bumps the version, under the saga's row lock, so a
-- command that says at which version it was written can be applied
-- without a read when nothing moved since. definition_version is the
-- version of its definition the saga runs, the one it started with, to
-- its end (version is the row's own counter). paused_at is when the saga
-- was paused (NULL: not; the who and why are its repair's); deadline_at
-- is when it is cancelled if it has not finished (its definition's
-- deadline, on the database clock at start; NULL: none).
create table idemsaga.sagas (
    id          uuid primary key,
    definition  text not null,
    idem_key    text not null,
    input_hash  bytea not null,
    input       jsonb not null,
    state       idemsaga.state_name not null,
    version     bigint not null default 1,
    results     jsonb not null default '{}'::jsonb,
    error       text,
    created_at  timestamptz not null default idemsaga.now(),
    updated_at  timestamptz not null default idemsaga.now(),
    finished_at timestamptz,
    paused_at   timestamptz,
    deadline_at timestamptz,
    definition_version idemsaga.definition_version not null default 1,
    constraint sagas_definition_key_unique unique (definition, idem_key)
);

-- Running sagas by age (worker list --stuck), and finished ones for the
-- retention cleaner.
create index sagas_running_idx on idemsaga.sagas (created_at) where finished_at is null;
create index sagas_finished_idx on idemsaga.sagas (finished_at) where finished_at is not null;

-- One row per (saga, step, phase). attempt is the fencing token: every
-- write about a step checks the attempt it expects, so a worker or a reply
-- of an older attempt never overwrites a newer one. possibly_done is set
-- once an attempt's outcome at another system was unknown. The current
-- attempt's timeline is the row itself (dispatched_at, status); attempts
-- that ended otherwise (a retry, a lease expiry) go to step_attempts.
create table idemsaga.steps (
    saga_id         uuid not null references idemsaga.sagas (id) on delete cascade,
    step            text not null,
    phase           idemsaga.phase not null,
    step_index      int not null,
    key             uuid not null,
    status          idemsaga.step_status not null,
    attempt         int not null,
    possibly_done   boolean not null default false,
    lease_until     timestamptz,
    next_attempt_at timestamptz,
    dispatched_at   timestamptz,
    last_error      text,
    result          jsonb,
    created_at      timestamptz not null default idemsaga.now(),
    updated_at      timestamptz not null default idemsaga.now(),
    primary key (saga_id, step, phase)
);

-- The reaper's two hot queries: expired leases and due retries.
create index steps_lease_idx on idemsaga.steps (lease_until) where status = 'dispatched';
create index steps_due_idx on idemsaga.steps (next_attempt_at) where status = 'retrying';
-- And a third, for callback steps: waits past their deadline.
create index steps_wait_idx on idemsaga.steps (lease_until) where status = 'waiting';

-- Attempts that did not end as the step's last word: a retry scheduled, a
-- lease expired, an outcome unknown, or one an operator's retry re-opened.
create table idemsaga.step_attempts (
    saga_id       uuid not null,
    step          text not null,
    phase         idemsaga.phase not null,
    attempt       int not null,
    dispatched_at timestamptz not null default idemsaga.now(),
    finished_at   timestamptz,
    outcome       idemsaga.attempt_outcome,
    error         text,
    primary key (saga_id, step, phase, attempt),
    foreign key (saga_id, step, phase) references idemsaga.steps (saga_id, step, phase) on delete cascade
);

-- One row per step key on the step side, written in the same transaction
-- as the step's business write (a database step) or around its call (an
-- external step), so a redelivered command returns the first outcome.
-- Saga ids are UUIDv7, ordered by time, so keyed by (saga_id, step_key) a
-- saga's claims land together at the right edge of the index. unknown is
-- set once an attempt of an external step ended with an unknown outcome.
-- A step's result is here, or, for a success applied to its saga in its
-- own transaction, in the step's row alone.
create table idemsaga.inbox (
    saga_id    uuid not null references idemsaga.sagas (id) on delete cascade,
    step_key   uuid not null,
    step       text not null,
    phase      idemsaga.phase not null,
    attempt    int not null,
    outcome    idemsaga.inbox_outcome not null,
    unknown    boolean not null default false,
    result     jsonb,
    error      text,
    created_at timestamptz not null default idemsaga.now(),
    primary key (saga_id, step_key)
);

-- Rows to publish. Claimed by state (published_at is null) with
-- FOR UPDATE SKIP LOCKED, never by "id greater than the last seen": ids are
-- taken at insert, not at commit, and such a relay would skip rows. The
-- process that commits a row publishes it right after the commit and
-- deletes it once the broker acknowledged it; publish_after is when the
-- relay may take it over (after a crash between commit and publish); NULL,
-- as for rows written by outbox.Write, makes it the relay's at once.
-- attempts and last_error make a row the broker refuses visible. saga_id,
-- when set, keeps the saga from retention while the row waits. No foreign
-- key: outbox.Write takes rows of the caller's that belong to no saga.
create table idemsaga.outbox (
    id            bigint generated always as identity primary key,
    subject       text not null,
    msg_id        text not null,
    payload       bytea not null,
    headers       jsonb,
    created_at    timestamptz not null default idemsaga.now(),
    publish_after timestamptz,
    published_at  timestamptz,
    saga_id       uuid,
    attempts      int not null default 0,
    last_error    text
);

create index outbox_unpublished_idx on idemsaga.outbox (id) where published_at is null;
create index outbox_published_idx on idemsaga.outbox (published_at) where published_at is not null;

-- invariant_broken raises when a write the engine makes under a saga's row
-- lock missed its row, which the lock rules out: it is a bug, reported as
-- one, and the whole transaction rolls back. No normal outcome calls it.
create function idemsaga.invariant_broken(what text) returns int
language plpgsql
as $$
begin
    raise exception using errcode = 'IDM00', message = 'idemsaga: invariant broken: ' || what,
        hint = 'this is a bug in idemsaga; nothing was written; report it with the saga''s `worker show --json`';
end
$$;

-- The deployment's shared settings, one row per name (stream,
-- subject_prefix, lease_grace): every process of a deployment must use
-- the same, since a client writes the first command's subject and
-- lease. The first process records them; every later one compares its
-- own and refuses to start on a difference. `migrate` of the runtime
-- records the settings it is given, which is how a deployment changes
-- them.
create table idemsaga.settings (
    name       text primary key,
    value      text not null,
    set_by     text not null,
    set_at     timestamptz not null default idemsaga.now()
);

-- The definitions a deployment runs, one row per (name, version), each
-- as its description (steps, kinds, policies; saga.Description): a
-- worker that runs another description of one version refuses to start,
-- a new version is a new row beside the old ones (whose sagas run on to
-- their end), and a process without a definition's code (the admin CLI,
-- a gateway) starts and repairs its sagas from it.
create table idemsaga.definitions (
    name        text not null,
    description jsonb not null,
    fingerprint text not null,
    set_by      text not null,
    set_at      timestamptz not null default idemsaga.now(),
    version     idemsaga.definition_version not null default 1,
    constraint definitions_pkey primary key (name, version)
);

-- The processes running engines, with the definitions each runs (and
-- their versions, as "name@version"), renewed every few seconds: the
-- admin CLI tells whether any live worker runs a saga's definition
-- version before it queues work for one.
create table idemsaga.workers (
    id          uuid primary key,
    host        text not null,
    pid         int not null,
    definitions text[] not null,
    started_at  timestamptz not null default idemsaga.now(),
    seen_at     timestamptz not null default idemsaga.now(),
    versions    text[] not null default '{}'
);

-- Every operator repair (retry, cancel, skip, close, pause, resume), with who asked and
-- why, keyed by the request's key: a repair sent again after a lost answer
-- finds its record, written in the repair's own transaction, and changes
-- nothing. A bulk repair records one row per saga, under a key derived
-- from the bulk request's.
create table idemsaga.repairs (
    saga_id      uuid not null references idemsaga.sagas (id) on delete cascade,
    request_key  text not null,
    operation    text not null check (operation in ('retry', 'cancel', 'skip', 'close', 'pause', 'resume')),
    request_hash bytea not null,
    reason       text not null,
    requested_by text not null,
    state_after  idemsaga.state_name not null,
    created_at   timestamptz not null default idemsaga.now(),

    -- The step a skip marked succeeded (null for the other repairs): its
    -- key holds a tombstone, not a success, in the inbox, and reconcile
    -- tells it from a step whose success went unrecorded by this row.
    step         text,
    phase        idemsaga.phase,
    constraint repairs_skip_names_step check ((operation = 'skip') = (step is not null and phase is not null)),
    primary key (saga_id, request_key)
);

-- Every callback received for a callback step, under the other system's
-- own id for the event (a payment channel's transaction number). The
-- primary key is the adjudicator: the first delivery of an event inserts
-- its row and, under the saga's lock, completes the step with a
-- conditional update; every later delivery finds the row and is answered
-- from it, and one with another body (body_hash) is refused. A callback
-- that came before the step's request was recorded stays pending and is
-- applied in the transaction that makes the step wait; one for a step
-- that no longer waits is kept as late, for a person, and reopens
-- nothing. Deleted with its saga.
create table idemsaga.callbacks (
    definition  text not null,
    step        text not null,
    event_id    text not null,
    saga_id     uuid not null references idemsaga.sagas (id) on delete cascade,
    body_hash   bytea not null,
    failed      boolean not null,
    result      jsonb,
    error       text,
    outcome     text not null check (outcome in ('applied', 'pending', 'late', 'superseded')),
    detail      text not null,
    received_at timestamptz not null default idemsaga.now(),
    applied_at  timestamptz,
    primary key (definition, step, event_id)
);

create index callbacks_saga_idx on idemsaga.callbacks (saga_id, step);
-- Submit tokens: the third source of saga keys, next to a client's own key
-- and a business key. The server issues a one-time token (for a form, say),
-- unguessable, for one definition and with a time to live; the submit that
-- carries it as its key consumes it with a conditional update in the very
-- statement that inserts its saga, so a rolled-back start leaves it unused
-- and any number of concurrent submits of one token start one saga. Once
-- consumed, the saga holds the token as its key: a resubmit is answered
-- from the saga for as long as the saga is kept, whatever the token's
-- expiry. The cleaner deletes a token once it expired, consumed or not.
create table idemsaga.submit_tokens (
    token       text primary key,
    definition  text not null,
    issued_at   timestamptz not null default idemsaga.now(),
    expires_at  timestamptz not null,
    saga_id     uuid,
    consumed_at timestamptz,
    constraint submit_tokens_consumed_whole check ((saga_id is null) = (consumed_at is null))
);

create index submit_tokens_expires_idx on idemsaga.submit_tokens (expires_at);


-- Pause and resume: a paused saga, or any saga of a paused definition,
-- starts no attempt: a step's claim checks both in the claim's own
-- statement, and the reaper neither takes over its leases nor dispatches
-- its retries, so a dependency that is down for an hour costs no
-- attempts. A resumed saga's steps in flight are sent again at their
-- attempt: a dispatched step with a next attempt time is the reaper's to
-- send again (never a lease to take over). Empty but right after a
-- resume.
create index steps_resend_idx on idemsaga.steps (next_attempt_at) where status = 'dispatched' and next_attempt_at is not null;

-- The paused sagas, for the sagas_paused metric.
create index sagas_paused_idx on idemsaga.sagas (paused_at) where paused_at is not null;

-- The reaper's look for sagas past their deadline.
create index sagas_deadline_idx on idemsaga.sagas (deadline_at) where finished_at is null and deadline_at is not null;

-- The definitions paused as a whole, with who paused them, when and why.
-- Their sagas start (a start is accepted and held) but run nothing until
-- the definition is resumed.
create table idemsaga.paused_definitions (
    definition   text primary key,
    request_key  text not null,
    reason       text not null,
    requested_by text not null,
    paused_at    timestamptz not null default idemsaga.now()
);

-- Every pause and resume of a definition, keyed by the request's key as a
-- saga's repairs are: a request sent again changes nothing.
create table idemsaga.definition_repairs (
    definition   text not null,
    request_key  text not null,
    operation    text not null check (operation in ('pause', 'resume')),
    request_hash bytea not null,
    reason       text not null,
    requested_by text not null,
    sagas        int not null,
    created_at   timestamptz not null default idemsaga.now(),
    primary key (definition, request_key)
);

-- Commands no worker that received them could run: their definition,
-- version or step unknown to it. After a bounded number of deliveries the
-- worker parks the message here and acknowledges it, instead of handing it
-- back to the broker forever; a worker that runs its version sends it
-- again through the outbox (deleting the row in the same transaction), and
-- a person can send it again or drop it. msg_id is the broker message id
-- (Nats-Msg-Id): a delivery seen again after it was parked changes
-- nothing. A parked command is one attempt of a step, fenced as any other
-- by the step's attempt and the inbox, so sending it again, or the reaper
-- driving the step meanwhile, runs nothing twice. first_seen is when the
-- message entered the stream.
create table idemsaga.dead_letters (
    id                 bigint generated always as identity primary key,
    msg_id             text not null constraint dead_letters_msg_id_unique unique,
    subject            text not null,
    payload            bytea not null,
    headers            jsonb,
    saga_id            uuid not null references idemsaga.sagas (id) on delete cascade,
    definition         text not null,
    definition_version idemsaga.definition_version not null,
    step               text not null,
    phase              idemsaga.phase not null,
    attempt            int not null check (attempt >= 1),
    reason             text not null,
    deliveries         int not null check (deliveries >= 1),
    parked_by          text not null,
    first_seen         timestamptz not null,
    last_seen          timestamptz not null default idemsaga.now()
);

create index dead_letters_saga_idx on idemsaga.dead_letters (saga_id);
create index dead_letters_definition_idx on idemsaga.dead_letters (definition, definition_version);
