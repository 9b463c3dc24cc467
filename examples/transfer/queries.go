package transfer

import (
	"embed"
	"io/fs"
)

func fsSub(f embed.FS, dir string) (fs.FS, error) { return fs.Sub(f, dir) }

// Each balance change writes its ledger row in the same statement (one
// round trip). The debit and the credit fail (transfer.refuse, migration
// 003) unless both happened: they run as the step's last statement
// (saga.StepContext.ExecLast), whose row count is never seen; a refused
// debit reads its account to tell why only then (migration 005). $3 is the
// saga, $4 the step.
const (
	debitSQL = `with a as (
  update transfer.accounts set balance = balance - $2 where id = $1 and balance >= $2 and not frozen returning id
), l as (
  insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, -$2::bigint from a returning 1
)
select case when exists (select 1 from l) then 0 else transfer.refuse_debit($1) end`
	creditSQL = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 and not frozen returning id
), l as (
  insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a returning 1
)
select case when exists (select 1 from l) then 0 else transfer.refuse('TR003') end`
	refundSQL = `with a as (
  update transfer.accounts set balance = balance + $2 where id = $1 returning id
)
insert into transfer.ledger (saga_id, step, account_id, amount) select $3, $4, id, $2::bigint from a`
)

// The codes transfer.refuse raises.
const (
	codeSourceUnavailable  = "TR001"
	codeInsufficientFunds  = "TR002"
	codeDestinationMissing = "TR003"
)
