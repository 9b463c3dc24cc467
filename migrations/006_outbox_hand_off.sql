-- Why: the process that commits an outbox row now publishes it itself,
-- right after the commit, and deletes the rows the broker acknowledged in
-- batches (outbox.Relay.Publish). That saves the relay's claim (a row lock
-- per message) and its round trips, and a message no longer waits for the
-- relay to wake. publish_after is when the relay's sweep may take such a
-- row over: after a crash between commit and publish, or a publish the
-- broker did not acknowledge. NULL, as for rows written by outbox.Write, lets
-- the relay publish the row at once.
alter table idemsaga.outbox add column publish_after timestamptz;
