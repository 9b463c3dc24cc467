package steps

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/saga"
)

// errWorkerOwnsTx is returned when a handler commits or rolls back the
// step's transaction, which the worker ends with the inbox record.
var errWorkerOwnsTx = errors.New("steps: the step's transaction is ended by the worker, together with its inbox record and reply; return nil to commit it, or an error to roll it back")

// errAfterLast is returned when a handler uses its transaction after
// StepContext.ExecLast.
// It is permanent: the handler would do the same on every attempt.
var errAfterLast = saga.Permanent(errors.New("steps: the handler used its transaction after StepContext.ExecLast, which must be its last statement; move ExecLast after every other use of the transaction"))

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
	// claim, when set and not sent, is the step's first round trip held
	// back for the handler's first statement (saga.Step.TxOnly): whatever
	// the handler does through the Tx sends it first, so the claim always
	// leads the transaction. A handler's Tx is not for concurrent use (no
	// pgx.Tx is), so it needs no lock.
	claim *claim
	// afterClaim, if set, runs once a held-back claim took the key; an
	// error it returns fails the claim.
	afterClaim func() error
	// claimCtx bounds a held-back claim sent by the methods that take no
	// context (Conn, LargeObjects): the attempt's. Kept for those alone.
	claimCtx context.Context
	// holdLast allows ExecLast to hold its statement back for the round
	// trip of the step's success (a TxOnly forward step's first run).
	holdLast bool
	// last is ExecLast's statement, held back; nil when it ran at once.
	last *lastStatement
	// lastUsed is set once the handler called ExecLast: the Tx is its no
	// more.
	lastUsed bool
}

var _ pgx.Tx = (*stepTx)(nil)

func newStepTx(conn *pgx.Conn) *stepTx { return &stepTx{conn: conn, step: &stepState{}} }

// holdClaim keeps c back until the handler's first statement, which it
// then leads in one round trip.
func (t *stepTx) holdClaim(ctx context.Context, c *claim, after func() error) {
	t.step.claim, t.step.afterClaim, t.step.claimCtx = c, after, ctx
}

// heldClaimCtx is the context of a claim sent by a method that takes none.
func (t *stepTx) heldClaimCtx() context.Context {
	if t.step.claimCtx != nil {
		return t.step.claimCtx
	}
	return context.Background()
}

// sendClaim sends a held-back claim, with sql after it if not empty (the
// handler's first statement, if it can travel in the claim's pipeline). It
// reports whether it sent one, sql's result, and the error of the claim or
// of sql; the claim's failure, and a duplicate delivery, end the Tx for the
// handler (saga.ErrDuplicateDelivery).
func (t *stepTx) sendClaim(ctx context.Context, sql string, args []any) (bool, pgconn.CommandTag, error) {
	c := t.step.claim
	if c == nil || c.sent {
		return false, pgconn.CommandTag{}, nil
	}
	tag, err := c.send(ctx, t.conn, sql, args)
	if c.err == nil && c.claimed == 1 && t.step.afterClaim != nil {
		c.err = t.step.afterClaim()
	}
	switch {
	case c.err != nil:
		t.close()
		return true, tag, c.err
	case c.claimed == 0:
		t.close()
		return true, tag, saga.ErrDuplicateDelivery
	}
	return true, tag, err
}

// pipelined reports whether a statement with these arguments can travel in
// a batch: pgx runs one without arguments, or with an explicit mode, its
// own way (the simple protocol allows several statements in one string).
func pipelined(args []any) bool {
	if len(args) == 0 {
		return false
	}
	_, mode := args[0].(pgx.QueryExecMode)
	return !mode
}

// claimFirst sends a held-back claim alone, before a statement that
// cannot travel with it.
func (t *stepTx) claimFirst(ctx context.Context) error {
	_, _, err := t.sendClaim(ctx, "", nil)
	return err
}

// close ends the Tx and its savepoints for the handler.
func (t *stepTx) close() { t.step.closed.Store(true) }

// done reports whether this Tx can no longer be used.
func (t *stepTx) done() bool { return t.step.closed.Load() || t.ended.Load() }

// usable returns why the handler can no longer use this Tx, if it cannot.
func (t *stepTx) usable() error {
	switch {
	case t.done():
		return pgx.ErrTxClosed
	case t.step.lastUsed:
		return errAfterLast
	}
	return nil
}

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.usable(); err != nil {
		return nil, err
	}
	if err := t.claimFirst(ctx); err != nil {
		return nil, err
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
	if err := t.usable(); err != nil {
		return err
	}
	t.ended.Store(true)
	_, err := t.conn.Exec(ctx, sql+t.name)
	return err
}

func (t *stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.usable(); err != nil {
		return 0, err
	}
	if err := t.claimFirst(ctx); err != nil {
		return 0, err
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.usable(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	if err := t.claimFirst(ctx); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects works through a pgx transaction value over the same
// connection. pgx offers no other way to build one; its BEGIN, sent inside
// the open transaction, only draws a warning from PostgreSQL.
func (t *stepTx) LargeObjects() pgx.LargeObjects {
	if err := t.usable(); err != nil {
		panic(fmt.Sprintf("steps: large objects of a step transaction: %v", err))
	}
	if err := t.claimFirst(t.heldClaimCtx()); err != nil {
		panic(fmt.Sprintf("steps: large objects in a step transaction: %v", err))
	}
	tx, err := t.conn.Begin(context.Background())
	if err != nil {
		panic(fmt.Sprintf("steps: large objects in a step transaction: %v", err))
	}
	return tx.LargeObjects()
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.usable(); err != nil {
		return nil, err
	}
	if err := t.claimFirst(ctx); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

// Exec runs the handler's statement; the first of a TxOnly step travels
// with the step's claim.
func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.usable(); err != nil {
		return pgconn.CommandTag{}, err
	}
	if pipelined(args) {
		if sent, tag, err := t.sendClaim(ctx, sql, args); sent {
			return tag, err
		}
	} else if err := t.claimFirst(ctx); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.usable(); err != nil {
		return nil, err
	}
	if err := t.claimFirst(ctx); err != nil {
		return nil, err
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.usable(); err != nil {
		return errRow{err}
	}
	if err := t.claimFirst(ctx); err != nil {
		return errRow{err}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the connection, after sending a held-back claim: whatever
// the handler runs on it must be inside the step's transaction. It panics
// (an error of the handler's, to the worker) once the transaction ended or
// when the claim failed or found a duplicate: the connection would then
// be outside any transaction, and its writes would commit on their own.
func (t *stepTx) Conn() *pgx.Conn {
	if err := t.usable(); err != nil {
		panic(fmt.Sprintf("steps: the connection of a step transaction: %v", err))
	}
	if err := t.claimFirst(t.heldClaimCtx()); err != nil {
		panic(fmt.Sprintf("steps: the connection of a step transaction: %v", err))
	}
	return t.conn
}

// ExecLast is saga.StepContext.ExecLast's: in a TxOnly forward step's
// first run, a statement that can travel in a batch is held back (see
// lastStatement); otherwise it runs at once.
func (t *stepTx) ExecLast(ctx context.Context, sql string, args ...any) error {
	if err := t.usable(); err != nil {
		return err
	}
	if t.step.holdLast && t.name == "" && pipelined(args) {
		t.step.last, t.step.lastUsed = &lastStatement{sql: sql, args: args}, true
		return nil
	}
	_, err := t.Exec(ctx, sql, args...)
	t.step.lastUsed = true
	return err
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
