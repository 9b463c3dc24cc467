// Package steps is the step-side runtime on its own: a Worker consumes
// commands from JetStream, runs each attempt of a step, and answers every
// outcome with a reply in the outbox, for the orchestrator. An engine
// (package engine) runs the same attempts itself and applies their
// outcomes to the saga in the step's own transaction.
//
// A worker shares the engine's database: the inbox, whose rows reference
// their saga, lives with the sagas. The runtime's `steps` command (package
// service) runs one: a process of steps only, beside the engines of `run`,
// which relay its replies and move the sagas.
//
// Guarantees:
//   - A database step's handler runs in the transaction of its inbox
//     claim: its writes, the claim and the reply commit together, or not
//     at all. A delivery whose key the inbox holds answers with the stored
//     outcome and runs nothing.
//   - An external step claims its attempt in a transaction of its own
//     before the call, holds no transaction or connection during it, and
//     records the outcome after it, fenced by the attempt: a duplicate of
//     an attempt being called does not call again, and an attempt that
//     ends without a known outcome is recorded as unknown.
//   - A compensation first fences the forward key: no late delivery of the
//     forward command can take effect after it, and the compensation runs
//     only if the forward step took effect or may have.
package steps
