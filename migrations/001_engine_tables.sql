-- Why: the engine's durable state. PostgreSQL is the source of truth for
-- every saga; NATS is only transport. All tables live in schema idemsaga.

-- One row per saga. (definition, idem_key) is unique: the database, not
-- application code, adjudicates concurrent starts of the same business intent.
create table idemsaga.sagas (
    id          uuid primary key,
    definition  text not null,
    idem_key    text not null,
    input_hash  bytea not null,
    input       jsonb not null,
    state       text not null,
    version     bigint not null default 1,
    results     jsonb not null default '{}'::jsonb,
    error       text,
    created_at  timestamptz not null default now(),
    updated_at  timestamptz not null default now(),
    finished_at timestamptz,
    constraint sagas_definition_key_unique unique (definition, idem_key)
);

create index sagas_running_idx on idemsaga.sagas (created_at) where finished_at is null;

-- One row per (saga, step, phase). attempt is the fencing token: every
-- write about a step checks the attempt it expects, so a worker or reply
-- from an older attempt can never overwrite a newer one.
create table idemsaga.steps (
    saga_id         uuid not null references idemsaga.sagas (id) on delete cascade,
    step            text not null,
    phase           text not null check (phase in ('forward', 'compensate')),
    step_index      int not null,
    key             uuid not null,
    status          text not null check (status in ('dispatched', 'retrying', 'succeeded', 'failed')),
    attempt         int not null,
    lease_until     timestamptz,
    next_attempt_at timestamptz,
    last_error      text,
    result          jsonb,
    created_at      timestamptz not null default now(),
    updated_at      timestamptz not null default now(),
    primary key (saga_id, step, phase),
    constraint steps_key_unique unique (key)
);

-- The reaper's two hot queries: expired leases and due retries.
create index steps_lease_idx on idemsaga.steps (lease_until) where status = 'dispatched';
create index steps_due_idx on idemsaga.steps (next_attempt_at) where status = 'retrying';

-- Rows to publish. Claimed by state (published_at is null) with
-- FOR UPDATE SKIP LOCKED, never by "id greater than the last seen": ids are
-- taken at insert, not at commit, and such a relay would skip rows.
create table idemsaga.outbox (
    id           bigint generated always as identity primary key,
    subject      text not null,
    msg_id       text not null,
    payload      bytea not null,
    headers      jsonb,
    created_at   timestamptz not null default now(),
    published_at timestamptz,
    -- The saga a row belongs to, if any: retention keeps a saga while it
    -- has rows not yet published.
    saga_id      uuid,
    -- Failed publish attempts and the last broker error, so a row the
    -- broker refuses (too large, say) is visible instead of silent.
    attempts     int not null default 0,
    last_error   text
);

create index outbox_unpublished_idx on idemsaga.outbox (id) where published_at is null;
create index outbox_unpublished_saga_idx on idemsaga.outbox (saga_id) where published_at is null;

-- One row per processed step key on the step side. It commits in the same
-- transaction as the business write, so a redelivered command returns the
-- first outcome. outcome 'tombstone' fences a forward step whose outcome
-- stayed unknown: a late delivery of its command then does nothing.
create table idemsaga.inbox (
    step_key   uuid primary key,
    saga_id    uuid not null,
    step       text not null,
    phase      text not null,
    attempt    int not null,
    outcome    text not null check (outcome in ('succeeded', 'failed', 'tombstone')),
    result     jsonb,
    error      text,
    created_at timestamptz not null default now()
);

-- One row per attempt of a step, for the saga's timeline: when it was
-- dispatched, when and how it ended (succeeded, failed, retry, lease
-- expired, given up). Written in the same statements as the step changes.
create table idemsaga.step_attempts (
    saga_id       uuid not null references idemsaga.sagas (id) on delete cascade,
    step          text not null,
    phase         text not null,
    attempt       int not null,
    dispatched_at timestamptz not null default now(),
    finished_at   timestamptz,
    outcome       text,
    error         text,
    primary key (saga_id, step, phase, attempt)
);
