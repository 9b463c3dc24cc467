-- Why: retention (engine.Cleaner) deletes, every minute and from every
-- worker, finished sagas past their window with their steps and inbox
-- rows, inbox rows whose saga is gone, and published outbox rows, in small
-- batches claimed with FOR UPDATE SKIP LOCKED. Without these indexes each
-- batch would scan a whole table. Only tables of migration 001 are used.
--
-- tern runs a migration in a transaction, so these are plain CREATE INDEX,
-- which blocks writes to the table while it builds. On a large live
-- database, build them first by hand with CREATE INDEX CONCURRENTLY under
-- the same names; IF NOT EXISTS then makes this migration a no-op.

-- Finished sagas, oldest first. Running sagas (finished_at null) are not
-- in it: they are never deleted.
create index if not exists sagas_finished_idx
    on idemsaga.sagas (finished_at) where finished_at is not null;

-- A saga's inbox rows, deleted in the same transaction as the saga.
create index if not exists inbox_saga_idx on idemsaga.inbox (saga_id);

-- Inbox rows by age, to find those whose saga is gone.
create index if not exists inbox_created_idx on idemsaga.inbox (created_at);

-- Published outbox rows by age. The relay's claim query keeps its own
-- partial index on unpublished rows (outbox_unpublished_idx).
create index if not exists outbox_published_idx
    on idemsaga.outbox (published_at) where published_at is not null;
