// Package outbox writes messages in the caller's transaction and relays them
// to NATS JetStream.
//
// A state change and the messages it causes commit together: Write inserts
// rows into idemsaga.outbox inside the caller's pgx.Tx. The Relay claims
// unpublished rows with FOR UPDATE SKIP LOCKED (so any number of relays can
// run at once), publishes each with a Nats-Msg-Id header, waits for the
// broker's acks, and deletes (or marks) the rows in the same transaction as
// the claim.
//
// The engine does better with its own commands and replies: it writes
// each row with a hand-off (publish_after), and right after the commit
// hands the rows to Relay.Publish, which publishes them at once and
// deletes the acknowledged ones in batches, with no claim. The relay's
// sweep leaves such a row alone until its hand-off has passed, then
// publishes it if it is still there: after a crash between the commit and
// the publish, or a publish the broker did not acknowledge.
//
// Guarantees: a committed row is published at least once. A relay that
// crashes after publishing and before deleting publishes the row again;
// the broker's dedup window usually drops that copy, and the consumers'
// inbox and fenced updates absorb it when it does not.
package outbox
