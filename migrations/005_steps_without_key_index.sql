-- Why: every lookup of a step now goes by its primary key (saga_id, step,
-- phase). The step key is derived from those three (UUIDv5), so its unique
-- index only repeated the primary key's guarantee, and being random it
-- cost an insert into a random leaf on every step write and every update
-- that is not HOT (a status change always moves an indexed column). The
-- column stays: it is what workers and downstream systems dedup on.
alter table idemsaga.steps drop constraint steps_key_unique;
