package transfer

import (
	"embed"
	"io/fs"
)

func fsSub(f embed.FS, dir string) (fs.FS, error) { return fs.Sub(f, dir) }

const (
	debitSQL   = `update transfer.accounts set balance = balance - $2 where id = $1 and balance >= $2 and not frozen`
	accountSQL = `select frozen from transfer.accounts where id = $1`
	creditSQL  = `update transfer.accounts set balance = balance + $2 where id = $1 and not frozen`
	refundSQL  = `update transfer.accounts set balance = balance + $2 where id = $1`
	ledgerSQL  = `insert into transfer.ledger (saga_id, step, account_id, amount) values ($1, $2, $3, $4)`
)
