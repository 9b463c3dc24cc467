// Package transfer is the money-transfer saga: deduct from one account,
// credit another, and refund the deduction when the credit cannot happen.
//
// States: init → deducted → credited; on failure compensating →
// compensated. Both steps are database steps: each changes one balance and
// writes one ledger row through sc.Tx, the transaction the engine records
// the step key in, so every effect happens once however often its command
// is delivered. A transfer that cannot happen (insufficient funds, a
// missing or frozen account) changes no row; the handler reads the row
// count and fails for good with saga.Permanent.
package transfer
