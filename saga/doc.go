// Package saga holds the public types of idemsaga: saga definitions, their
// steps and states and the transitions between them, step keys, retry
// policies and the errors handlers return to steer the engine. It depends
// on no other idemsaga package, so handlers can import it alone.
//
// A definition is a named, ordered list of steps, validated once by New.
// Every step says how it takes effect:
//
//	def, err := saga.New("checkout",
//		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: reserve, Compensate: release},
//		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: charge, Compensate: refund},
//	)
//
// Handlers are usually typed functions adapted with Handle, which decodes
// the saga input and encodes the step's result:
//
//	charge := saga.Handle(func(ctx context.Context, sc *saga.StepContext, o Order) (Receipt, error) {
//		return payments.Charge(ctx, o, sc.Key) // sc.Key deduplicates downstream
//	})
//
// # The handler contract
//
// A handler runs once per attempt, and its error decides: nil is a
// success; an error marked with Permanent fails the step for good; any
// other error is retried under the step's RetryPolicy (RetryAfter asks for
// a given delay). What an error says about the step's effect depends on
// its Kind:
//
//   - DatabaseStep: the handler's writes go through sc.Tx, the
//     transaction that records sc.Key in the inbox and commits the
//     outcome. A success commits them; any error rolls them back. The step
//     took effect exactly when its success committed.
//   - ExternalStep: the handler calls another system with sc.Key as the
//     idempotency key, and holds no transaction (sc.Tx is nil). An error
//     marked Permanent or NotApplied says the other system did not act;
//     any other error, a timeout, a crash or a lost lease leaves the
//     attempt's outcome unknown, and the step possibly done.
//   - ChildStep: the engine runs the step: it starts Step.Child as a
//     saga of its own under ChildKey(sc.Key), and the child's end decides
//     the step (its results are the step's result). The step's Forward,
//     optional, only returns the child's input: Permanent fails the step
//     with no child started, any other error is retried. Its compensation
//     is the child's: the engine cancels or compensates the child.
//
// When a forward step is given up, the steps before it are compensated in
// reverse order. A possibly-done step is compensated first, under its own
// compensation key (sc.ForwardUnknown is set); one without a compensation
// parks the saga in StateParked, for a person.
//
// # The boundary with other systems
//
// An external or callback step may also have a Verify, which asks the
// other system what the step's key did when an attempt's outcome is
// unknown, before the engine retries, compensates or parks; a Limit, which
// bounds its calls (at once, per period, per key) across every worker; and
// its handler may call StepContext.Heartbeat during a long call. Package
// saga/httpcall makes an attempt's HTTP request right by default.
//
// # Guarantees
//
//   - A saga moves one way: StateInit, then the state each step reaches, in
//     order; on failure StateCompensating, then StateCompensated or, when
//     compensation cannot finish, StateFailed; StateParked when a possibly
//     done step cannot be undone; StateClosed when an operator closed a
//     failed or parked saga as handled. CanTransition encodes this graph,
//     which has no cycles, and nothing leaves a terminal state (an
//     operator's repair is not a transition).
//   - StepKey is a UUIDv5 over (saga ID, step, phase): the same on every
//     attempt, worker and restart, and different for every other step or
//     phase of the saga. Pass it downstream as an idempotency key.
//   - A definition has a version (WithVersion, 1 by default): a saga runs
//     the steps of the version it started with to its end, so a changed
//     definition is deployed as a new version beside the old one.
//   - CanonicalInput encodes inputs that differ only in key order or
//     whitespace to the same bytes, keeping numbers as written, so a
//     resent Start is recognised as the same intent.
package saga
