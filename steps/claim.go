package steps

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
	// claimed is 1 when this transaction took the key, 0 when the inbox
	// held it already (then st is what it holds).
	claimed int64
	st      stored
	// read is set once the inbox's answer arrived.
	read bool
	sent bool
	// err is the claim's own failure, or one injected after it: nothing
	// will commit, and the command is to be delivered again.
	err error
}

func newClaim(cmd wire.Command, policy saga.RetryPolicy) *claim {
	return &claim{cmd: cmd, policy: policy}
}

// send sends the claim, and sql after it if not empty (a handler's first
// statement), and returns sql's result. A failure of the claim itself is
// in c.err; a duplicate (c.claimed 0) returns no error and leaves no
// transaction open.
func (c *claim) send(ctx context.Context, conn *pgx.Conn, sql string, args []any) (pgconn.CommandTag, error) {
	c.sent = true
	var tag pgconn.CommandTag
	if err := prepare(ctx, conn, claimStatements); err != nil {
		c.err = fmt.Errorf("claim step key: %w", err)
		return tag, c.err
	}
	b := &pgx.Batch{}
	b.Queue(claimIdle.name, idleTimeoutFor(c.policy))
	b.Queue(claimInsert.name, pguuid.Of(c.cmd.Key), pguuid.Of(c.cmd.SagaID), c.cmd.Step, c.cmd.Phase, c.cmd.Attempt)
	b.Queue(claimRead.name, pguuid.Of(c.cmd.SagaID), pguuid.Of(c.cmd.Key))
	b.Queue(claimCheck.name)
	b.Queue(claimBegin.name)
	if sql != "" {
		b.Queue(sql, args...)
	}
	br := conn.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil {
		err = br.QueryRow().Scan(&c.claimed)
	}
	if err == nil {
		if err = c.st.scan(br.QueryRow()); err == nil {
			c.read = true
		}
	}
	var check error
	if err == nil {
		_, check = br.Exec()
	}
	var pgErr *pgconn.PgError
	switch {
	case err != nil:
		_ = br.Close()
		c.err = fmt.Errorf("claim step key: %w", err)
		return tag, c.err
	case c.claimed == 0 && errors.As(check, &pgErr) && pgErr.Code == claimedElsewhere:
		// A duplicate: nothing after the check ran. pgx drops from its
		// cache every statement of a batch that failed, to prepare them
		// again on their next use; the handler's statement did not even
		// run, so it stays (QueuedQueries is what pgx goes through).
		b.QueuedQueries = nil
		_ = br.Close()
		return tag, nil
	case check != nil:
		_ = br.Close()
		c.err = fmt.Errorf("claim step key: %w", check)
		return tag, c.err
	case c.claimed == 0:
		_ = br.Close()
		c.err = errors.New("claim step key: the key was held, yet the claim did not stop")
		return tag, c.err
	}
	if _, err := br.Exec(); err != nil { // BEGIN
		_ = br.Close()
		c.err = fmt.Errorf("claim step key: %w", err)
		return tag, c.err
	}
	if sql != "" {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
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
