-- A step's lease runs from the delivery of its command, not from its
-- dispatch: a command that waits in the broker's queue has not started its
-- attempt, and its expiry there must not cost one. claimed_attempt is the
-- attempt whose command a step worker received late (past half the lease
-- grace, or delivered again) and whose lease it restarted then; the
-- reaper takes over an expired lease only from an attempt that a worker
-- claimed (this column, the key's lock held, or the inbox's started row),
-- and sends an unclaimed one again at the same attempt.
alter table idemsaga.steps add column claimed_attempt int;
