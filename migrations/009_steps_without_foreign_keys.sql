-- Why: every step row inserted (one per step of every saga) fired the
-- foreign key's check on idemsaga.sagas: a query through SPI and a row
-- lock with its WAL record, about 3% of PostgreSQL's CPU per saga on the
-- benchmark. The engine writes a saga's steps and attempts only with the
-- saga (Start) or under its lock (each write fenced by the saga's state
-- and version, or by the step's attempt), and the retention cleaner now
-- deletes steps and attempts with their saga in one transaction, as the
-- cascade did. `worker reconcile` reports any step or attempt row whose
-- saga is missing.
alter table idemsaga.steps drop constraint if exists steps_saga_id_fkey;
alter table idemsaga.step_attempts drop constraint if exists step_attempts_saga_id_fkey;
