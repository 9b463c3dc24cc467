package attempt

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/saga"
)

// handlerTx is the saga.Tx a database step's handler writes through: the
// attempt's transaction, begun with the step's claim. It only passes
// statements to the connection, and refuses them once the attempt ended
// it, so a handler that kept it cannot write outside its transaction.
type handlerTx struct {
	conn   *pgx.Conn
	closed atomic.Bool
}

var _ saga.Tx = (*handlerTx)(nil)

func (t *handlerTx) close() { t.closed.Store(true) }

func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed.Load() {
		return errRow{pgx.ErrTxClosed}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed.Load() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.conn.SendBatch(ctx, b)
}

func (t *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error) {
	if t.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, rows)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
