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

create domain idemsaga.step_status as text
    constraint step_status_known check (value in ('dispatched', 'retrying', 'succeeded', 'failed'));

-- What the inbox holds for a step key. Final: succeeded, failed (a
-- permanent failure, or attempts exhausted), tombstone (given up or
-- fenced by a compensation: no later delivery may take effect). Not final,
-- for external steps only: started (the attempt in "attempt" claimed its
-- call and recorded no outcome yet: it is calling, or its process died)
-- and retry (that attempt ended without effect, or with an unknown
-- outcome; another attempt may start).
create domain idemsaga.inbox_outcome as text
    constraint inbox_outcome_known check (value in ('started', 'retry', 'succeeded', 'failed', 'tombstone'));

create domain idemsaga.attempt_outcome as text
    constraint attempt_outcome_known check (value in ('succeeded', 'failed', 'retry', 'unknown', 'lease expired'));

-- One row per saga. (definition, idem_key) is unique: the database, not
-- application code, adjudicates concurrent starts of one business intent.
-- Every change of a saga or of one of its steps is a conditional update on
-- (state, version) that bumps the version, under the saga's row lock, so a
-- command that says at which version it was written can be applied
-- without a read when nothing moved since.
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

-- The definitions a deployment runs, each as its description (steps,
-- kinds, policies; saga.Description): a worker that runs another
-- description of one name refuses to start, and a process without a
-- definition's code (the admin CLI, a gateway) starts and repairs its
-- sagas from it.
create table idemsaga.definitions (
    name        text primary key,
    description jsonb not null,
    fingerprint text not null,
    set_by      text not null,
    set_at      timestamptz not null default idemsaga.now()
);

-- The processes running engines, with the definitions each runs, renewed
-- every few seconds: the admin CLI tells whether any live worker runs a
-- definition before it queues work for one.
create table idemsaga.workers (
    id          uuid primary key,
    host        text not null,
    pid         int not null,
    definitions text[] not null,
    started_at  timestamptz not null default idemsaga.now(),
    seen_at     timestamptz not null default idemsaga.now()
);

-- Every operator repair (retry, cancel), with who asked and why, keyed by
-- the request's key: a repair sent again after a lost answer finds its
-- record, written in the repair's own transaction, and changes nothing.
create table idemsaga.repairs (
    saga_id      uuid not null references idemsaga.sagas (id) on delete cascade,
    request_key  text not null,
    operation    text not null check (operation in ('retry', 'cancel')),
    request_hash bytea not null,
    reason       text not null,
    requested_by text not null,
    state_after  idemsaga.state_name not null,
    created_at   timestamptz not null default idemsaga.now(),
    primary key (saga_id, request_key)
);

-- ---------------------------------------------------------------------
-- Definition versions and dead letters (rolling deploys).
--
-- A definition carries a version: a saga runs the steps of the version it
-- started with to its end, while new sagas start on the newest. The saga
-- records its version (definition_version; version above is the row's
-- optimistic-concurrency counter), the deployment records one description
-- per (name, version), and each worker says which versions it runs
-- ("name@version"), so a process can tell whether anyone can run a saga.
alter table idemsaga.sagas add column definition_version int not null default 1
    constraint sagas_definition_version_check check (definition_version >= 1);
alter table idemsaga.definitions add column version int not null default 1
    constraint definitions_version_check check (version >= 1);
alter table idemsaga.definitions drop constraint definitions_pkey;
alter table idemsaga.definitions add constraint definitions_pkey primary key (name, version);
alter table idemsaga.workers add column versions text[] not null default '{}';

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
    definition_version int not null check (definition_version >= 1),
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
