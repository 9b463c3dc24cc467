package transfer

import (
	"embed"
	"io/fs"
)

func fsSub(f embed.FS, dir string) (fs.FS, error) { return fs.Sub(f, dir) }

// Each balance change writes its ledger row in the same statement (one
// round trip); the statement reports one row affected if and only if both
// happened. $3 is the saga, $4 the step.
const (
	debitSQL = `with a as (
  update transfer.accounts set balance = balance - $2 where id = $1 and balance >= $2 and not frozen returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, -$2::bigint from a`
	accountSQL = `select frozen from transfer.accounts where id = $1`
	creditSQL  = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 and not frozen returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a`
	refundSQL = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a`
)
