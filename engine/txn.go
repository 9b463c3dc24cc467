package engine

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// txn is an engine transaction whose writes are pipelined. A write is
// queued with a check of its result; the queue reaches PostgreSQL in one
// round trip when the transaction next reads or commits, and a failed check
// makes the caller roll back.
//
// Applying a reply writes three or four statements whose outcome the engine
// knows in advance, since it holds the saga's row lock. Sent one by one
// they cost a round trip each, and on a small machine the round trips
// (a system call and a wake-up on each side), not the work, were most of a
// saga's CPU (docs/benchmarks.md).
type txn struct {
	tx    pgx.Tx
	batch *pgx.Batch
}

func newTxn(tx pgx.Tx) *txn { return &txn{tx: tx} }

// queue adds a write. check receives its one result row (an UPDATE or
// INSERT ... RETURNING, or a SELECT over a data-modifying CTE) when the
// queue is flushed; it must wrap any error it returns with what failed.
func (t *txn) queue(sql string, check func(pgx.Row) error, args ...any) {
	if t.batch == nil {
		t.batch = &pgx.Batch{}
	}
	t.batch.Queue(sql, args...).QueryRow(check)
}

// flush sends the queued writes and runs their checks. The first error
// stops the checks after it; the transaction must then be rolled back.
func (t *txn) flush(ctx context.Context) error {
	if t.batch == nil || t.batch.Len() == 0 {
		return nil
	}
	b := t.batch
	t.batch = nil
	return t.tx.SendBatch(ctx, b).Close()
}

// read flushes the queued writes, so that a read sees them, and returns
// the transaction to read with.
func (t *txn) read(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	return t.tx, nil
}

// commit flushes the queued writes and commits.
func (t *txn) commit(ctx context.Context) error {
	if err := t.flush(ctx); err != nil {
		return err
	}
	return t.tx.Commit(ctx)
}
