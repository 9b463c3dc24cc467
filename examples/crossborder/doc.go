// Package crossborder is the cross-border transfer saga: it debits an
// account in its currency, converts the amount at the FX desk when the
// destination account holds another currency, and credits the
// destination. The conversion is a saga of its own, the child saga fx,
// started by the transfer's child step:
//
//	crossborder:  debit  →  fx (child step, only across currencies)  →  credit
//	              refund     cancel or compensate the child
//	fx:           quote  →  convert
//	              void       reverse
//
// Every step is a database step: each moves money (an account's or the
// desk's) and writes its ledger rows through sc.Tx, the transaction the
// engine records the step key in, so each movement happens once however
// often its command is delivered, and the child is started under a key
// derived from the fx step's key, so a redelivered fx step finds the
// same child.
//
// The fx step carries a condition: it runs only when the debit's result
// says the two accounts hold different currencies; in one currency it
// is skipped, recorded as skipped, and never compensated. Its Forward
// builds the child's input (sell, buy, amount) from the debit's result;
// the child's results (the quote and the conversion) are the step's
// result, and the credit pays what the conversion bought.
//
// A conversion the desk cannot pay (ErrDeskShort) fails the child, which
// voids its quote and ends compensated: the fx step failed without
// effect, and the transfer refunds the debit. A credit refused for good
// (a frozen or missing destination, ErrDestinationUnavailable) after the
// conversion compensates the child whole (its conversion reversed, its
// quote voided) before the debit is refunded. Audit checks that every
// currency's money, accounts and desk together, is what Seed put in,
// and that a transfer that ended compensated left no movement behind,
// its child's included.
package crossborder
