-- Limits that another system sets (saga.Limit) hold across every worker
-- and process that shares this database, so they are kept here, not in a
-- process's memory.
--
-- limit_holds: one row per call that runs under a concurrency bound, held
-- from before the attempt's claim until its outcome is recorded. scope is
-- '' for the limit's own bound and the key's value for its per-key bound
-- (a tenant); holder names one turn (one delivery of one attempt), so two
-- deliveries of an attempt never share a hold. A hold of a process that
-- died lapses at until, which the holder pushes forward as it pushes its
-- step's lease; a new hold is taken under an advisory lock per (name,
-- scope), so that a count and an insert cannot interleave.
create table idemsaga.limit_holds (
    name   text not null,
    scope  text not null,
    holder uuid not null,
    until  timestamptz not null,
    primary key (name, scope, holder)
);
-- A turn pushes and releases its holds by holder.
create index limit_holds_holder_idx on idemsaga.limit_holds (holder);

-- limit_rates: a rate bound's schedule (the generic cell rate algorithm):
-- next_at is the earliest time the next call may start. A call reserves
-- its start by moving next_at on by the rate's spacing in one conditional
-- upsert, then waits until its start: no two calls get the same start,
-- and the reservations of every process are spaced evenly.
create table idemsaga.limit_rates (
    name    text primary key,
    next_at timestamptz not null
);

-- verified: the step's Verify answered that its key took no effect, after
-- the last attempt whose outcome was unknown (which also clears unknown).
-- A step given up so is not possibly done: its own compensation still runs
-- first, to void the key against a request still on its way, but a step
-- without one does not park.
alter table idemsaga.inbox add column verified boolean not null default false;

-- verify_attempt: the attempt that asks the step's Verify alone, sent
-- after the last attempt's lease ran out during its call (the worker
-- stopped): its command is written the same way if it must be sent again.
alter table idemsaga.steps add column verify_attempt int;
