// Package order is the order saga: reserve stock in the database, charge
// the customer at a payment service over HTTP, then ship.
//
//	reserve (database step)  →  charge (external step)  →  ship (database step)
//	release stock               refund
//
// reserve takes stock and writes its reservation through sc.Tx; release
// gives them back. charge calls the payment service (package payments)
// with sc.Key as its Idempotency-Key and holds no transaction while it
// waits; refund calls it with its own key, naming the charge's
// (sc.ForwardKey), and is harmless when nothing was charged. ship writes
// the shipment, and fails for good for an address it cannot reach, which
// refunds the charge and releases the stock.
//
// A charge whose answer was lost (a timeout, a dropped connection, a 500)
// may have gone through: the step is possibly done, and when it is given
// up its refund runs first, whatever the last attempt said.
package order
