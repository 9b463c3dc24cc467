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

// claim is a step's first round trip: BEGIN, a bound on how long the
// transaction may sit idle (a stalled or stopped process must not hold the
// key forever: the engine settles abandoned steps through the same inbox
// row), the claim of the step key, and the read of what the inbox holds
// for it. For a TxOnly step it waits for the handler's first statement and
// travels with it (stepTx).
type claim struct {
	batch *pgx.Batch
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
	c := &claim{batch: &pgx.Batch{}}
	c.batch.Queue("begin")
	c.batch.Queue(idleTimeout, idleTimeoutFor(policy))
	c.batch.Queue(claimKey, pguuid.Of(cmd.Key), pguuid.Of(cmd.SagaID), cmd.Step, cmd.Phase, cmd.Attempt).
		Exec(func(tag pgconn.CommandTag) error { c.claimed = tag.RowsAffected(); return nil })
	c.batch.Queue(readStored, pguuid.Of(cmd.SagaID), pguuid.Of(cmd.Key)).QueryRow(func(row pgx.Row) error {
		if err := c.st.scan(row); err != nil {
			return err
		}
		c.read = true
		return nil
	})
	return c
}

// send sends the claim, with whatever more queues after it (a handler's
// first statement), and returns the error of that statement; a failure of
// the claim itself is in c.err.
func (c *claim) send(ctx context.Context, conn *pgx.Conn, more func(*pgx.Batch)) error {
	c.sent = true
	if more != nil {
		more(c.batch)
	}
	err := conn.SendBatch(ctx, c.batch).Close()
	if !c.read {
		if err == nil {
			err = errors.New("the inbox gave no answer")
		}
		c.err = fmt.Errorf("claim step key: %w", err)
		return c.err
	}
	return err
}
