// Package outbox writes messages in the caller's transaction and relays them
// to NATS JetStream.
//
// A state change and the messages it causes commit together: Write inserts
// rows into idemsaga.outbox inside the caller's pgx.Tx. The Relay claims
// unpublished rows with FOR UPDATE SKIP LOCKED (so any number of relays can
// run at once), publishes each with a Nats-Msg-Id header, waits for the
// broker's acks, and marks the rows published in the same transaction as
// the claim.
//
// Guarantees: a committed row is published at least once. A relay that
// crashes after publishing and before marking publishes the row again; the
// broker's dedup window usually drops that copy, and the consumers' inbox
// and fenced updates absorb it when it does not.
package outbox
