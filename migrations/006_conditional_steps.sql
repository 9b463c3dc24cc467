-- A conditional step's decision (saga.Condition) is taken once, in the
-- move that reaches it, and kept with the saga: skipped names the steps
-- a saga skipped, in order. The planner reads it from the saga (and the
-- commands carry it) so that no redelivery, repair or later build decides
-- again, and a skipped step is never compensated. A skipped step has no
-- row in steps: it has no key and no attempt.
alter table idemsaga.sagas add column skipped text[] not null default '{}';
