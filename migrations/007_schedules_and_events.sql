-- Sagas started by a schedule (saga.WithSchedule) and by events
-- (saga.WithEvents).
--
-- schedules: one row per definition name with a schedule, written by the
-- engines that run it. last_tick is the latest tick handled (started, or
-- skipped by the catch-up policy or a pause): the ticks after it and up
-- to idemsaga.now() are due. The first engine that runs a schedule
-- inserts its row with last_tick at its start, so nothing before it is
-- due. A pass of a scheduler locks the row (for update skip locked),
-- starts the due ticks' sagas and moves last_tick in one transaction: a
-- tick is started once, and the unique (definition, key) of sagas stands
-- behind it. last_started is the tick of the latest saga it started.
create table idemsaga.schedules (
    definition   text primary key,
    cron         text not null,
    last_tick    timestamptz not null,
    last_started timestamptz,
    paused_at    timestamptz,
    paused_by    text,
    pause_reason text,
    created_at   timestamptz not null default idemsaga.now(),
    updated_at   timestamptz not null default idemsaga.now(),
    constraint schedules_pause_whole check ((paused_at is null) = (paused_by is null) and (paused_at is null) = (pause_reason is null))
);

-- schedule_repairs: each pause and resume of a schedule, under its
-- request key, so that the same request sent again changes nothing (as
-- definition_repairs does for definitions).
create table idemsaga.schedule_repairs (
    definition   text not null references idemsaga.schedules (definition) on delete cascade,
    request_key  text not null,
    operation    text not null check (operation in ('pause', 'resume')),
    request_hash bytea not null,
    reason       text not null,
    requested_by text not null,
    created_at   timestamptz not null default idemsaga.now(),
    primary key (definition, request_key)
);

-- event_dead_letters: messages of a definition's events that could not
-- start a saga (no key header, a key or body refused), kept with why, and
-- acknowledged: they are not delivered again. One row per message of the
-- stream, so a delivery again of one recorded is not recorded twice.
create table idemsaga.event_dead_letters (
    id          bigint generated always as identity primary key,
    definition  text not null,
    stream      text not null,
    stream_seq  bigint not null check (stream_seq >= 1),
    subject     text not null,
    event_key   text,
    headers     jsonb,
    payload     bytea not null,
    reason      text not null,
    deliveries  int not null check (deliveries >= 1),
    parked_by   text not null,
    created_at  timestamptz not null default idemsaga.now(),
    constraint event_dead_letters_message_unique unique (definition, stream, stream_seq)
);
