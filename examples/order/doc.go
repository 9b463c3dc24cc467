// Package order is the order saga: reserve stock in the database and
// charge the customer at a payment service over HTTP, at once (a
// parallel group), then ship, unless the goods are digital (a
// conditional step).
//
//	┌ reserve (database step) ┐
//	│ release stock           │  →  ship (database step, skipped for digital goods)
//	│ charge (callback step)  │
//	└ refund                  ┘
//
// The saga reaches "prepared" when both branches succeeded. If one fails
// for good (out of stock, card declined), the other finishes its attempt
// (a charge that waits for its confirmation is given up at once, as
// possibly done), and whichever succeeded or may have taken effect is
// undone: the stock released, the charge refunded or its key voided.
//
// reserve takes stock and writes its reservation through sc.Tx; release
// gives them back. charge calls the payment service (package payments)
// through saga/httpcall: one request per attempt, sc.Key as its
// Idempotency-Key, no transaction held while it waits. refund calls it
// with its own key, naming the charge's (sc.ForwardKey): it gives the
// charge back, or voids the key if the charge never came, so that a late
// charge under it is refused (a compensation that closes the door). ship writes
// the shipment, and fails for good for an address it cannot reach, which
// refunds the charge and releases the stock.
//
// After an attempt whose outcome is unknown, the charge's Verify asks the
// service about the key (GET /charges/{key}): a charge found is the step's
// success, with no second request; none found makes the attempt not
// applied. Config.WithoutVerify leaves it out, for comparison.
//
// A charge whose answer was lost (a timeout, a dropped connection, a 500,
// a 503 the service gives before it looks at the key) may have gone
// through: the step is possibly done, and when it is given
// up its refund runs first, whatever the last attempt said.
package order
