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
// step than a pgx transaction, which sends each on its own.
//
// The same type is a savepoint of it (Begin, as a pgx transaction does):
// then name is set, and Commit and Rollback release or roll back to it.
type stepTx struct {
	conn *pgx.Conn
	// step is shared by the step's transaction and its savepoints.
	step *stepState
	// name is the savepoint's, empty for the step's transaction.
	name string
	// ended is set once this savepoint was released or rolled back.
	ended atomic.Bool
}

type stepState struct {
	// closed is set once the worker ended the transaction, so a handler
	// that kept the Tx cannot use it after.
	closed atomic.Bool
	// savepoints numbers nested transactions.
	savepoints atomic.Int64
}

var _ pgx.Tx = (*stepTx)(nil)

func newStepTx(conn *pgx.Conn) *stepTx { return &stepTx{conn: conn, step: &stepState{}} }

// close ends the Tx and its savepoints for the handler.
func (t *stepTx) close() { t.step.closed.Store(true) }

// done reports whether this Tx can no longer be used.
func (t *stepTx) done() bool { return t.step.closed.Load() || t.ended.Load() }

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.done() {
		return nil, pgx.ErrTxClosed
	}
	name := fmt.Sprintf("idemsaga_sp_%d", t.step.savepoints.Add(1))
	if _, err := t.conn.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &stepTx{conn: t.conn, step: t.step, name: name}, nil
}

func (t *stepTx) Commit(ctx context.Context) error { return t.end(ctx, "release savepoint ") }

func (t *stepTx) Rollback(ctx context.Context) error { return t.end(ctx, "rollback to savepoint ") }

func (t *stepTx) end(ctx context.Context, sql string) error {
	if t.name == "" {
		return errWorkerOwnsTx
	}
	if t.done() {
		return pgx.ErrTxClosed
	}
	t.ended.Store(true)
	_, err := t.conn.Exec(ctx, sql+t.name)
	return err
}

func (t *stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.done() {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.done() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects works through a pgx transaction value over the same
// connection. pgx offers no other way to build one; its BEGIN, sent inside
// the open transaction, only draws a warning from PostgreSQL.
func (t *stepTx) LargeObjects() pgx.LargeObjects {
	if t.done() {
		panic("steps: large objects of a step transaction that has ended")
	}
	tx, err := t.conn.Begin(context.Background())
	if err != nil {
		panic(fmt.Sprintf("steps: large objects in a step transaction: %v", err))
	}
	return tx.LargeObjects()
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.done() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.done() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.done() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.done() {
		return errRow{pgx.ErrTxClosed}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *stepTx) Conn() *pgx.Conn { return t.conn }

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
