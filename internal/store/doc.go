// Package store is the one writer of a saga's state: every statement that
// changes a saga, its steps, its inbox rows, its callbacks, its repairs or
// the outbox is named here (river's riverdriver plays this part). The
// orchestrator, the reaper, every repair, pause, deadline and callback, and
// the step runner write through it; so does the one pipelined transaction
// (Tx) and the one map of SQLSTATEs (Interpret). The public outbox.Write,
// for a user's own messages, and the relay's bookkeeping of published rows
// stay with package outbox.
//
// The rules the statements keep, which reconcile checks from outside (each
// check is a Rule, in this package, beside the statements that keep it):
//   - a saga moves only from the state and version its writer read
//     (fenced in SQL, never raised on a miss); under the saga's lock a miss
//     is a bug (idemsaga.invariant_broken);
//   - a step's key takes an attempt only from nothing or from an earlier
//     attempt that ended without effect (retry); a final outcome stands;
//   - a compensation fences its forward key first (FenceForward), so a
//     late delivery of the forward command takes no effect after it;
//   - every command or reply is an outbox row written in the transaction
//     that decided it (outboxInsert), unless the step it dispatches runs in
//     this process at once, whose step row's lease is then its record.
//
// The next wave fits the plan as follows. Steps that run in parallel: a
// move dispatches a set of steps, each with its own row, key and command;
// the step part and the command part of the record statements take one
// row each today and take arrays (unnest) when a group dispatches several,
// and a group's named state is reached by the move whose step is the
// group's last to succeed (the saga's version fences the race). A step
// skipped by a condition: a step row written succeeded with a recorded
// decision and no key taken, never compensated. A child saga: a step
// whose claim starts the child's saga under a key derived from the step
// key (StartSaga), so a redelivered parent step finds the same child.
package store
