-- A step's lease runs from the delivery of its command, not from its
-- dispatch: a command that waits in the broker's queue has not started its
-- attempt, and its expiry there must not cost one. claimed_attempt is the
-- attempt whose lease restarted at its claim: a step worker that received
-- its command late (past half the lease grace, or delivered again) marks
-- it, and so does the reaper when it finds the attempt running unmarked.
-- The reaper takes over an expired lease only from a claimed attempt; an
-- unclaimed one is kept at its attempt, and sent again if it was lost.
alter table idemsaga.steps add column claimed_attempt int;
