package steps

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// claim is a step's first round trip: a bound on how long the transaction
// may sit idle (a stalled or stopped process must not hold the key
// forever: the engine settles abandoned steps through the same inbox row),
// the claim of the step key, the read of what the inbox holds for it, and
// BEGIN. For a TxOnly step it waits for the handler's first statement and
// travels with it (stepTx).
//
// Its statements run in the pipeline's implicit transaction until BEGIN,
// which makes that the step's transaction, the claim included. A key the
// inbox holds already raises before BEGIN (claimedOrRaise): PostgreSQL
// then rolls the implicit transaction back by itself, so a duplicate costs
// one round trip and leaves nothing to end.
type claim struct {
	cmd    wire.Command
	policy saga.RetryPolicy
	// simple is set when the pool runs pgx's simple protocol, which knows
	// no prepared statements: the claim then goes as SQL text, one
	// multi-statement query, which is one implicit transaction too.
	simple bool
	// claimed is 1 when this transaction took the key, 0 when the inbox
	// held it already (then st is what it holds).
	claimed int64
	st      stored
	sent    bool
	// err is the claim's own failure, or one injected after it: nothing
	// will commit, and the command is to be delivered again.
	err error
}

func newClaim(cmd wire.Command, policy saga.RetryPolicy, simple bool) *claim {
	return &claim{cmd: cmd, policy: policy, simple: simple}
}

// send sends the claim, and sql after it if not empty (a handler's first
// statement), and returns sql's result. A failure of the claim itself is
// in c.err; a duplicate (c.claimed 0) returns no error and leaves no
// transaction open.
func (c *claim) send(ctx context.Context, conn *pgx.Conn, sql string, args []any) (pgconn.CommandTag, error) {
	c.sent = true
	var tag pgconn.CommandTag
	name := func(s statement) string { return s.name }
	if c.simple {
		name = func(s statement) string { return s.sql }
	} else if err := prepare(ctx, conn, claimStatements); err != nil {
		c.err = fmt.Errorf("claim step key: %w", err)
		return tag, c.err
	}
	b := &pgx.Batch{}
	b.Queue(name(claimIdle), idleTimeoutFor(c.policy))
	b.Queue(name(claimInsert), pguuid.Of(c.cmd.Key), pguuid.Of(c.cmd.SagaID), c.cmd.Step, c.cmd.Phase, c.cmd.Attempt).
		QueryRow(func(row pgx.Row) error { return row.Scan(&c.claimed) })
	b.Queue(name(claimRead), pguuid.Of(c.cmd.SagaID), pguuid.Of(c.cmd.Key)).
		QueryRow(func(row pgx.Row) error { return c.st.scan(row) })
	b.Queue(name(claimCheck))
	begun := false
	b.Queue(name(claimBegin)).Exec(func(pgconn.CommandTag) error { begun = true; return nil })
	if sql != "" {
		b.Queue(sql, args...).Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	}
	err := pgbatch.Run(ctx, conn, b)

	var pre pgx.ErrPreprocessingBatch
	switch {
	case sql != "" && errors.As(err, &pre) && pre.SQL() == sql:
		// pgx prepares and encodes a batch before it sends any of it: the
		// handler's statement failed there, and nothing went out. The
		// claim goes alone, then the statement, whose error is the
		// handler's as ever.
		if _, err := c.send(ctx, conn, "", nil); err != nil || c.claimed == 0 {
			return tag, err
		}
		return conn.Exec(ctx, sql, args...)
	case c.claimed == 0 && !begun && pgbatch.Raised(err):
		// A duplicate, raised by the check: nothing after it ran, and
		// PostgreSQL rolled the implicit transaction back.
		return tag, nil
	case !begun:
		if err == nil {
			err = errors.New("the claim did not complete")
		}
		c.err = fmt.Errorf("claim step key: %w", err)
		return tag, c.err
	case c.claimed == 0:
		c.err = errors.New("claim step key: the key was held, yet the claim went on")
		return tag, c.err
	}
	// The claim holds; err, if any, is the handler's statement's.
	return tag, err
}

// statement is one the worker prepares by name on each connection it
// uses. pgx drops every statement of a batch that fails from its cache,
// and prepares them again on their next use (two round trips more); a
// duplicate's claim fails by design, so its statements are prepared by
// name, which pgx leaves alone.
type statement struct{ name, sql string }

// The claim's statements, in their order in its pipeline.
var (
	claimIdle       = statement{"idemsaga_claim_idle", idleTimeout}
	claimInsert     = statement{"idemsaga_claim_insert", claimKey}
	claimRead       = statement{"idemsaga_claim_read", readStored}
	claimCheck      = statement{"idemsaga_claim_check", claimedOrRaise}
	claimBegin      = statement{"idemsaga_claim_begin", "begin"}
	claimStatements = []statement{claimIdle, claimInsert, claimRead, claimCheck, claimBegin}
)

// prepare prepares on conn the statements it does not hold yet: one round
// trip each, once per connection.
func prepare(ctx context.Context, conn *pgx.Conn, stmts []statement) error {
	for _, s := range stmts {
		if _, err := conn.Prepare(ctx, s.name, s.sql); err != nil {
			return fmt.Errorf("prepare %s: %w", s.name, err)
		}
	}
	return nil
}
