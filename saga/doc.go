// Package saga holds the public types of idemsaga: saga definitions, their
// states and the transitions between them, step keys, retry policies and the
// errors handlers return to steer the engine. It depends on no other
// idemsaga package, so handlers can import it alone.
//
// A definition is a named, ordered list of steps, validated once by New:
//
//	def, err := saga.New("checkout",
//		saga.Step{Name: "reserve", Reaches: "reserved", Forward: reserve, Compensate: release},
//		saga.Step{Name: "charge", Reaches: "charged", Forward: charge},
//	)
//
// Handlers are usually typed functions adapted with Handle, which decodes
// the saga input and encodes the step's result:
//
//	charge := saga.Handle(func(ctx context.Context, sc *saga.StepContext, o Order) (Receipt, error) {
//		return payments.Charge(ctx, o, sc.Key) // sc.Key deduplicates downstream
//	})
//
// # Guarantees
//
//   - A saga moves one way: StateInit, then the state each step reaches, in
//     order; on failure StateCompensating, then StateCompensated or, when
//     compensation cannot finish, StateFailed. CanTransition encodes this
//     graph, which has no cycles, and nothing leaves a terminal state.
//   - StepKey is a UUIDv5 over (saga ID, step, phase): the same on every
//     attempt, worker and restart, and different for every other step or
//     phase of the saga. Pass it downstream as an idempotency key.
//   - CanonicalInput encodes inputs that differ only in key order or
//     whitespace to the same bytes, keeping numbers as written, so a
//     resent Start is recognised as the same intent.
//   - An error is retried under the step's RetryPolicy unless marked with
//     Permanent; RetryAfter asks for a given delay before the next attempt.
package saga
