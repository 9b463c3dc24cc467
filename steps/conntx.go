package steps

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// errWorkerOwnsTx is returned when a handler commits or rolls back the
// step's transaction, which the worker ends with the inbox record.
var errWorkerOwnsTx = errors.New("steps: the step's transaction is ended by the worker, together with its inbox record and reply; return nil to commit it, or an error to roll it back")

// stepTx is the pgx.Tx a handler receives. It runs on a connection whose
// BEGIN travelled in one round trip with the inbox claim, and whose COMMIT
// travels with the inbox result and the reply: two round trips fewer per
// step than a pgx transaction, which sends each on its own. Begin gives a
// savepoint, as a pgx transaction does.
type stepTx struct {
	conn *pgx.Conn
	// closed is set once the worker ended the transaction, so a handler
	// that kept the Tx cannot use it after.
	closed atomic.Bool
	// savepoints numbers nested transactions.
	savepoints atomic.Int64
}

var _ pgx.Tx = (*stepTx)(nil)

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	name := fmt.Sprintf("idemsaga_sp_%d", t.savepoints.Add(1))
	if _, err := t.conn.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &savepointTx{stepTx: t, name: name}, nil
}

func (t *stepTx) Commit(context.Context) error   { return errWorkerOwnsTx }
func (t *stepTx) Rollback(context.Context) error { return errWorkerOwnsTx }

func (t *stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed.Load() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects works through a pgx transaction value over the same
// connection. pgx offers no other way to build one; its BEGIN, sent inside
// the open transaction, only draws a warning from PostgreSQL.
func (t *stepTx) LargeObjects() pgx.LargeObjects {
	if t.closed.Load() {
		panic("steps: large objects of a step transaction that has ended")
	}
	tx, err := t.conn.Begin(context.Background())
	if err != nil {
		panic(fmt.Sprintf("steps: large objects in a step transaction: %v", err))
	}
	return tx.LargeObjects()
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed.Load() {
		return errRow{pgx.ErrTxClosed}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *stepTx) Conn() *pgx.Conn { return t.conn }

// savepointTx is a nested transaction of a step's transaction.
type savepointTx struct {
	*stepTx
	name  string
	ended bool
}

// done reports whether the savepoint, or the step's transaction, ended.
func (s *savepointTx) done() bool { return s.ended || s.closed.Load() }

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if s.done() {
		return nil, pgx.ErrTxClosed
	}
	return s.stepTx.Begin(ctx)
}

func (s *savepointTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if s.done() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return s.stepTx.Exec(ctx, sql, args...)
}

func (s *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if s.done() {
		return nil, pgx.ErrTxClosed
	}
	return s.stepTx.Query(ctx, sql, args...)
}

func (s *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if s.done() {
		return errRow{pgx.ErrTxClosed}
	}
	return s.stepTx.QueryRow(ctx, sql, args...)
}

func (s *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if s.done() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return s.stepTx.SendBatch(ctx, b)
}

func (s *savepointTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if s.done() {
		return 0, pgx.ErrTxClosed
	}
	return s.stepTx.CopyFrom(ctx, table, columns, src)
}

func (s *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if s.done() {
		return nil, pgx.ErrTxClosed
	}
	return s.stepTx.Prepare(ctx, name, sql)
}

func (s *savepointTx) Commit(ctx context.Context) error {
	if s.ended || s.closed.Load() {
		return pgx.ErrTxClosed
	}
	s.ended = true
	_, err := s.conn.Exec(ctx, "release savepoint "+s.name)
	return err
}

func (s *savepointTx) Rollback(ctx context.Context) error {
	if s.ended || s.closed.Load() {
		return pgx.ErrTxClosed
	}
	s.ended = true
	_, err := s.conn.Exec(ctx, "rollback to savepoint "+s.name)
	return err
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
