package transfer

import (
	"embed"
	"io/fs"
)

func fsSub(f embed.FS, dir string) (fs.FS, error) { return fs.Sub(f, dir) }

// Each balance change writes its ledger row in the same statement, so a
// step is one statement in its transaction. The debit and the credit
// change nothing when they cannot take effect: the handler reads the row
// count and says why.
const (
	debitSQL = `with a as (
  update transfer.accounts set balance = balance - $2 where id = $1 and balance >= $2 and not frozen returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, -$2::bigint from a`

	creditSQL = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 and not frozen returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a`

	// A refund lands even on a frozen account: it returns the customer's
	// own money.
	refundSQL = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a`

	// accountState tells a refused debit's two causes apart, only when
	// one was refused.
	accountState = `select frozen from transfer.accounts where id = $1`
)
