-- Why: the inbox's primary key was the step key alone, a UUIDv5 and so
-- random: every claim inserted into a random leaf of an index as large as
-- the inbox (two rows per saga step, kept for the replay window), and once
-- that index outgrew shared_buffers each claim read a page from disk. The
-- key is now (saga_id, step_key). Saga ids are UUIDv7, ordered by time, so
-- a saga's claims land next to each other at the right edge of the index.
-- A step key is derived from its saga id, so the pair is exactly as unique
-- as the key; every lookup has both. The saga index of migration 003 is
-- the new key's prefix, and goes.
--
-- Rebuilding the key locks the inbox while it runs: on a large inbox, run
-- this migration in a quiet moment. Stop the workers of older versions
-- first: their claims name the old key (ON CONFLICT (step_key)) and fail
-- against the new one, so they would refuse every command (nothing is
-- lost, the commands wait) until they are replaced.
alter table idemsaga.inbox drop constraint inbox_pkey;
alter table idemsaga.inbox add primary key (saga_id, step_key);
drop index if exists idemsaga.inbox_saga_idx;
