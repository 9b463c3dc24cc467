-- Why: the outbox's saga index (migration 001) served one question, asked
-- by the cleaner once per batch: does a finished saga still have messages
-- waiting to be published? Every outbox row paid an index entry for it,
-- two per saga step. The cleaner's anti-join now reads the waiting rows
-- through the index of unpublished rows, which holds only what is
-- waiting (a nested loop over a handful, a hash join over many).
drop index if exists idemsaga.outbox_unpublished_saga_idx;
