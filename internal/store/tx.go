package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/outbox"
)

// Tx is a transaction whose statements are pipelined: each is queued with
// a callback for its result, and the queue reaches PostgreSQL in one round
// trip at the next Flush or Commit. BEGIN travels with the first batch and
// COMMIT with the last, so a transaction that reads once and then writes
// costs two round trips.
//
// An implicit Tx (Implicit) sends its whole queue at Commit as one batch
// without BEGIN or COMMIT: PostgreSQL runs a pipeline up to its Sync as one
// transaction, committed at the Sync, so a transaction of one batch costs
// one round trip and nothing to end.
//
// It is the engine's only pipelined transaction: the orchestrator, the
// reaper, the operator's repairs and every step attempt write through it,
// with this package's statements.
// Writes that must touch a row are fenced in SQL (by a saga's version, a
// step's attempt) and report what they touched; none raises on a normal
// outcome.
type Tx struct {
	conn *pgx.Conn
	// schema is the deployment's: each batch's statements are rewritten
	// for it when sent.
	schema   *pgschema.Schema
	implicit bool
	// nested is a savepoint in a caller's transaction (Within).
	nested bool
	// begun is set once BEGIN is queued (it goes with the first batch).
	begun bool
	// done is set once the transaction committed or rolled back;
	// committed once PostgreSQL answered its COMMIT.
	done, committed bool
	batch           *pgx.Batch
	sent            []outbox.Committed
	// trace is the trace context the commands of moves queued on the
	// transaction carry (SetTrace).
	trace map[string]string
}

// SetTrace makes the commands of the moves queued on t from now on
// (QueueMove) carry the trace context h, as message headers.
func (t *Tx) SetTrace(h map[string]string) { t.trace = h }

// Trace returns the trace context SetTrace gave, nil for none.
func (t *Tx) Trace() map[string]string { return t.trace }

// Begin returns a transaction on conn, in schema, that begins with its
// first batch. Call Rollback (a no-op after Commit) before releasing conn.
func Begin(conn *pgx.Conn, schema *pgschema.Schema) *Tx { return &Tx{conn: conn, schema: schema} }

// savepoint names the savepoint of a nested transaction (Within).
const savepoint = "idemsaga_tx"

// Within returns a transaction nested in outer, a caller's open
// transaction, as a savepoint that begins with its first batch: Commit
// releases it (the caller's commit makes its writes durable, or its
// rollback undoes them), Rollback undoes its writes alone and leaves outer
// usable. Its outbox rows are the relay's once outer commits: nothing is
// published after Commit.
func Within(outer pgx.Tx, schema *pgschema.Schema) *Tx {
	return &Tx{conn: outer.Conn(), schema: schema, nested: true}
}

// Nested reports a transaction within a caller's (Within).
func (t *Tx) Nested() bool { return t.nested }

// Implicit returns a transaction of one batch, sent at Commit as
// PostgreSQL's implicit transaction. It must not Flush.
func Implicit(conn *pgx.Conn, schema *pgschema.Schema) *Tx {
	return &Tx{conn: conn, schema: schema, implicit: true}
}

// Conn returns the connection, for reads that the queue must not wait for.
func (t *Tx) Conn() *pgx.Conn { return t.conn }

// Schema returns the transaction's schema: statements sent on Conn run
// in it through Schema().Q(Conn()).
func (t *Tx) Schema() *pgschema.Schema { return t.schema }

// Queue adds a statement that returns one row; scan receives it when the
// queue is sent. scan must wrap any error it returns with what failed.
func (t *Tx) Queue(sql string, scan func(pgx.Row) error, args ...any) {
	t.next().Queue(sql, args...).QueryRow(scan)
}

// Exec adds a statement whose command tag done receives (nil: ignored).
func (t *Tx) Exec(sql string, done func(pgconn.CommandTag) error, args ...any) {
	q := t.next().Queue(sql, args...)
	if done != nil {
		q.Exec(done)
	}
}

// Query adds a statement whose rows read receives.
func (t *Tx) Query(sql string, read func(pgx.Rows) error, args ...any) {
	t.next().Queue(sql, args...).Query(read)
}

// Sent records an outbox row the transaction wrote, for its publish after
// the commit.
func (t *Tx) Sent(c outbox.Committed) { t.sent = append(t.sent, c) }

// Published returns the outbox rows the transaction wrote.
func (t *Tx) Published() []outbox.Committed { return t.sent }

// SetPublished replaces the outbox rows the transaction wrote: a commit
// whose answer was lost reports them from what the database holds.
func (t *Tx) SetPublished(rows []outbox.Committed) { t.sent = rows }

// IsImplicit reports a transaction of one batch (Implicit).
func (t *Tx) IsImplicit() bool { return t.implicit }

func (t *Tx) next() *pgx.Batch {
	if t.batch == nil {
		t.batch = &pgx.Batch{}
		switch {
		case t.begun || t.implicit:
		case t.nested:
			t.batch.Queue("savepoint " + savepoint)
		default:
			t.batch.Queue("begin")
		}
		t.begun = true
	}
	return t.batch
}

// Flush sends the queued statements and runs their callbacks. On an error
// the transaction is to be rolled back.
func (t *Tx) Flush(ctx context.Context) error {
	if t.implicit {
		return errors.New("store: an implicit transaction is sent whole, at Commit")
	}
	return t.send(ctx)
}

func (t *Tx) send(ctx context.Context) error {
	if t.batch == nil {
		return nil
	}
	b := t.batch
	t.batch = nil
	return Interpret(t.schema.Q(t.conn).SendBatch(ctx, b).Close())
}

// Commit sends the queued statements with COMMIT (an implicit transaction
// without it) and checks that the transaction ended committed.
func (t *Tx) Commit(ctx context.Context) error {
	if t.done {
		return errors.New("store: the transaction already ended")
	}
	if !t.begun {
		t.done = true
		return nil // nothing was queued
	}
	switch {
	case t.nested:
		t.next().Queue("release savepoint " + savepoint)
	case !t.implicit:
		t.next().Queue("commit").Exec(func(tag pgconn.CommandTag) error {
			if tag.String() == "ROLLBACK" {
				return errors.New("the transaction had failed; COMMIT rolled it back")
			}
			return nil
		})
	}
	err := t.send(ctx)
	if st := t.conn.PgConn().TxStatus(); err == nil && !t.nested && st != 'I' {
		err = errors.New("the transaction is still open after its last batch")
	} else if err == nil && t.nested && st != 'T' {
		err = errors.New("the caller's transaction is not open after the savepoint's release")
	}
	if err != nil {
		return fmt.Errorf("write and commit: %w", err)
	}
	t.done, t.committed = true, true
	return nil
}

// Committed reports whether the transaction is known to have committed:
// its COMMIT (or, implicit, its batch) was answered. An error on the way
// leaves it false, committed or not.
func (t *Tx) Committed() bool { return t.committed }

// CommitAndBegin commits as Commit does and, in the same round trip, begins
// the next transaction on the connection with the statements then queues
// on it. It returns that transaction, open, and whether t committed: an
// error after t's COMMIT is the next transaction's (t committed; roll the
// next one back).
func (t *Tx) CommitAndBegin(ctx context.Context, then func(next *Tx)) (next *Tx, committed bool, err error) {
	if t.done || t.implicit || t.nested || !t.begun {
		return nil, false, errors.New("store: CommitAndBegin needs an explicit transaction of its own with its statements queued")
	}
	b := t.next()
	b.Queue("commit").Exec(func(tag pgconn.CommandTag) error {
		if tag.String() == "ROLLBACK" {
			return errors.New("the transaction had failed; COMMIT rolled it back")
		}
		committed = true
		t.committed = true
		return nil
	})
	next = &Tx{conn: t.conn, schema: t.schema, batch: b, begun: true}
	b.Queue("begin")
	then(next)
	t.batch, next.batch = nil, nil
	err = Interpret(t.schema.Q(t.conn).SendBatch(ctx, b).Close())
	t.done = true
	if err != nil {
		if committed {
			return next, true, fmt.Errorf("begin the next transaction: %w", err)
		}
		return nil, false, fmt.Errorf("write and commit: %w", err)
	}
	return next, true, nil
}

// Rollback ends a transaction that did not commit, if one is open. A
// connection it cannot clean is closed by the pool on release.
func (t *Tx) Rollback(ctx context.Context) {
	done := t.done
	t.done = true
	t.batch = nil
	if t.nested {
		if t.begun && !done {
			_, _ = t.conn.Exec(context.WithoutCancel(ctx), "rollback to savepoint "+savepoint+"; release savepoint "+savepoint)
		}
		return
	}
	if t.conn.PgConn().TxStatus() == 'I' {
		return
	}
	_, _ = t.conn.Exec(context.WithoutCancel(ctx), "rollback")
}
