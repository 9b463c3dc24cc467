-- Why: PostgreSQL 15 rebuilds a table's CHECK constraints from their
-- stored text (parse, then plan the expression) in every statement that
-- writes a row to it. On this project's benchmark machine an UPDATE by
-- primary key of a table with the two checks of idemsaga.steps cost
-- 31-40 us of backend CPU against 15-17 us without them, and a two-step
-- saga writes the steps table in four statements and the inbox in two:
-- about a twentieth of PostgreSQL's CPU per saga.
--
-- The values these checks guarded (a step's phase and status, an inbox
-- row's outcome) are written only from the engine's own constants, never
-- from user input. `worker reconcile` (engine.Reconcile) reports any row
-- holding another value.
alter table idemsaga.steps drop constraint if exists steps_phase_check;
alter table idemsaga.steps drop constraint if exists steps_status_check;
alter table idemsaga.inbox drop constraint if exists inbox_outcome_check;
