// Package transfer is the money-transfer saga: deduct from one account,
// credit another, and refund the deduction when the credit cannot happen.
//
// States: init → deducted → credited; on failure compensating →
// compensated. Each step changes one balance and writes one ledger row in
// the transaction the engine records the step key in, so every effect
// happens once however often its command is delivered.
package transfer
