// Package steps is the step-side runtime: it consumes commands from
// JetStream, runs the step's handler inside a transaction that also records
// the step key in the inbox, and writes the reply to the outbox in that same
// transaction. It acknowledges a command only after that commit.
//
// Run inside an engine (Config.ApplyFunc), a success needs no reply: the
// engine moves the saga on in the step's own transaction, and the worker
// publishes the next command right after the commit (Config.PublishFunc).
//
// Guarantees:
//   - A command whose key is already in the inbox returns the stored outcome
//     and runs nothing: each step key's business effect happens once.
//   - A handler error rolls back the inbox row with the business write, so
//     the next attempt does the work.
//   - A compensate command first records a tombstone under the forward
//     step's key. If the forward command had not run, it never will, and
//     there is nothing to undo; if it had, its compensation runs.
package steps
