package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// txn is an engine transaction whose statements are pipelined. A statement
// is queued with a callback for its result; the queue reaches PostgreSQL in
// one round trip when the transaction next reads or commits.
//
// On a connection (newConnTxn) BEGIN travels with the first batch and
// COMMIT with the last, so applying a reply costs two round trips: lock
// and read, then write and commit. Writes that must touch a row check
// themselves in SQL (idemsaga.expect, migration 004): a miss raises,
// PostgreSQL skips the rest of the pipeline, COMMIT included, and the
// caller rolls back.
//
// On a round trip, not the work it carries, went most of a saga's CPU on a
// small machine (docs/benchmarks.md).
type txn struct {
	db    batcher
	conn  *pgxpool.Conn // set for a transaction begun lazily on a connection
	q     querier       // set for a transaction another owner commits (inTxn)
	begun bool
	batch *pgx.Batch
	// sent holds the outbox rows written, for their publish after commit.
	sent []outbox.Committed
}

type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// newTxn wraps a transaction already begun.
func newTxn(tx pgx.Tx) *txn { return &txn{db: tx, begun: true} }

// newConnTxn starts a transaction on conn with its first batch. Call
// rollback (a no-op after commit) before releasing conn.
func newConnTxn(conn *pgxpool.Conn) *txn { return &txn{db: conn, conn: conn} }

// inTxn joins a transaction open on conn that its owner ends (a step
// worker's): b holds the owner's statements not yet sent, and the engine's
// go with them. The owner sends what pending returns, with its COMMIT.
func inTxn(conn *pgx.Conn, b *pgx.Batch) *txn {
	return &txn{db: conn, q: conn, begun: true, batch: b}
}

// pending returns the statements queued and not sent, and forgets them.
func (t *txn) pending() *pgx.Batch {
	b := t.batch
	t.batch = nil
	return b
}

// queue adds a statement. fn receives its one result row (a SELECT, an
// UPDATE or INSERT ... RETURNING, or a SELECT over data-modifying CTEs)
// when the queue is flushed; it must wrap any error it returns with what
// failed.
func (t *txn) queue(sql string, fn func(pgx.Row) error, args ...any) {
	t.batchFor().Queue(sql, args...).QueryRow(fn)
}

func (t *txn) batchFor() *pgx.Batch {
	if t.batch == nil {
		t.batch = &pgx.Batch{}
		if !t.begun {
			t.batch.Queue("begin")
			t.begun = true
		}
	}
	return t.batch
}

// flush sends the queued statements and runs their callbacks. The first
// error stops the callbacks after it; the transaction must then be rolled
// back.
func (t *txn) flush(ctx context.Context) error {
	if t.batch == nil {
		return nil
	}
	b := t.batch
	t.batch = nil
	return checkError(pgbatch.Run(ctx, t.db, b))
}

// read flushes the queued writes, so that a read sees them, and returns
// the transaction to read with.
func (t *txn) read(ctx context.Context) (querier, error) {
	if t.conn != nil && !t.begun {
		t.batchFor()
	}
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	switch {
	case t.q != nil:
		return t.q, nil
	case t.conn != nil:
		return t.conn, nil
	}
	return t.db.(pgx.Tx), nil
}

// commit flushes the queued writes and commits.
func (t *txn) commit(ctx context.Context) error {
	if t.conn == nil {
		if err := t.flush(ctx); err != nil {
			return err
		}
		return t.db.(pgx.Tx).Commit(ctx)
	}
	if !t.begun {
		return nil // nothing was sent
	}
	t.batchFor().Queue("commit").Exec(func(tag pgconn.CommandTag) error {
		if tag.String() == "ROLLBACK" {
			return errors.New("the transaction had failed; COMMIT rolled it back")
		}
		return nil
	})
	err := t.flush(ctx)
	if err == nil && t.conn.Conn().PgConn().TxStatus() != 'I' {
		err = errors.New("commit: the transaction is still open after COMMIT")
	}
	if err != nil {
		return fmt.Errorf("write and commit: %w", err)
	}
	t.begun = false
	return nil
}

// rollback ends a transaction begun on a connection that did not commit.
// A connection it cannot clean is closed by the pool on release.
func (t *txn) rollback(ctx context.Context) {
	if t.conn == nil || !t.begun || t.conn.Conn().PgConn().TxStatus() == 'I' {
		return
	}
	_, _ = t.conn.Exec(context.WithoutCancel(ctx), "rollback")
}

// querier is what reads inside a txn need.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// checkError turns the SQLSTATEs of idemsaga.expect into the engine's
// errors, wrapping the PostgreSQL error.
func checkError(err error) error {
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) {
		return err
	}
	// The PostgreSQL error stays in the chain: a step key's claim that
	// travelled in the same batch raises IDM02 too, and the step worker
	// reads its stored outcome from it (steps, lastStatement).
	switch pgErr.Code {
	case "IDM01":
		return fmt.Errorf("%w: %w", saga.ErrConflict, err)
	case "IDM02":
		return fmt.Errorf("%w (%w)", errAlreadyApplied, err)
	case "IDM03":
		return fmt.Errorf("%w: %w", saga.ErrNotFound, err)
	}
	return err
}

// stepID names a step row by its primary key, (saga, step, phase). The
// step key is derived from the same three and has no index of its own
// (migration 005): a random UUID index grows slowly with the table.
type stepID struct {
	saga  uuid.UUID
	step  string
	phase saga.Phase
}

// args returns the three as the first parameters of a statement, followed
// by more.
func (s stepID) args(more ...any) []any {
	return append([]any{pguuid.Of(s.saga), s.step, string(s.phase)}, more...)
}
