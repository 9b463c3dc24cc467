package steps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// claim is a step's first round trip: the claim of the step key, with a
// bound on how long the transaction may sit idle (a stalled or stopped
// process must not hold the key forever: the engine settles abandoned
// steps through the same inbox row), and BEGIN. For a TxOnly step it waits
// for the handler's first statement and travels with it (stepTx).
//
// Its statements run in the pipeline's implicit transaction until BEGIN,
// which makes that the step's transaction, the claim included. A key the
// inbox holds already raises before BEGIN (claimKey), with what the inbox
// holds for it: PostgreSQL then rolls the implicit transaction back by
// itself, so a duplicate costs one round trip and leaves nothing to end.
// That includes a duplicate whose first delivery committed while this
// claim waited for it. When the claim, the handler's held-back last
// statement and the success are the whole transaction, in one batch, BEGIN
// and COMMIT are left out (inOneTrip): the implicit transaction is then
// the step's, committed at the batch's Sync.
type claim struct {
	cmd    wire.Command
	policy saga.RetryPolicy
	// claimed is 1 when this transaction took the key, 0 when the inbox
	// held it already (then st is what it holds).
	claimed int64
	st      stored
	sent    bool
	// begun is set once the claim's BEGIN ran (in one trip, once the
	// claim itself did): the claim took the key.
	begun bool
	// err is the claim's own failure, or one injected after it: nothing
	// will commit, and the command is to be delivered again.
	err error
	// queued is the claim in the batch it was last queued on, and begin
	// the BEGIN after it.
	queued, begin *pgx.QueuedQuery
}

func newClaim(cmd wire.Command, policy saga.RetryPolicy) *claim {
	return &claim{cmd: cmd, policy: policy}
}

// queue adds the claim and BEGIN to b, first: the statements after them
// are the step's transaction.
func (c *claim) queue(b *pgx.Batch) {
	c.sent, c.begun, c.claimed, c.err = true, false, 0, nil
	c.st = stored{}
	c.queued = b.Queue(claimKey, pguuid.Of(c.cmd.Key), pguuid.Of(c.cmd.SagaID), c.cmd.Step, c.cmd.Phase, c.cmd.Attempt, idleTimeoutFor(c.policy))
	c.begin = b.Queue("begin")
	c.begin.Exec(func(pgconn.CommandTag) error { c.begun = true; return nil })
}

// inOneTrip makes b, the batch the claim was last queued on and leads, not
// yet sent, the whole transaction, for a caller that queues no COMMIT
// after it: PostgreSQL runs a pipeline up to its one Sync as one implicit
// transaction, which it commits at the Sync (and a failure there is the
// batch's error), so BEGIN and COMMIT are left out; and since it arms the
// idle bound only when it answers a Sync, the claim goes without it
// (claimKeyInOneTrip). The claim's own completion then tells that it took
// the key. It reports false, changing nothing, if b is not so led.
func (c *claim) inOneTrip(b *pgx.Batch) bool {
	if c.begun || c.queued == nil || c.queued.SQL != claimKey || len(b.QueuedQueries) < 2 ||
		b.QueuedQueries[0] != c.queued || b.QueuedQueries[1] != c.begin {
		return false
	}
	c.queued.SQL = claimKeyInOneTrip
	c.queued.Arguments = c.queued.Arguments[:5]
	c.queued.Exec(func(pgconn.CommandTag) error { c.begun = true; return nil })
	b.QueuedQueries = slices.Delete(b.QueuedQueries, 1, 2)
	return true
}

// settle judges the claim from err, the error of the batch it led: it
// sets c.claimed to 1 when the claim took the key and BEGIN ran (err, if
// any, is then a later statement's), and otherwise records a duplicate (a
// raise before BEGIN: nothing after it ran, and PostgreSQL rolled the
// implicit transaction back) or the claim's own failure in c.err.
func (c *claim) settle(err error) {
	switch {
	case c.begun:
		c.claimed = 1
	case pgbatch.Raised(err):
		c.claimed = 0
		if err := c.st.fromRaise(err); err != nil {
			c.err = fmt.Errorf("claim step key: the key is taken, and %w", err)
		}
	default:
		if err == nil {
			err = errors.New("the claim did not complete")
		}
		c.err = fmt.Errorf("claim step key: %w", err)
	}
}

// send sends the claim, and sql after it if not empty (a handler's first
// statement), and returns sql's result. A failure of the claim itself is
// in c.err; a duplicate (c.claimed 0) returns no error and leaves no
// transaction open.
func (c *claim) send(ctx context.Context, conn *pgx.Conn, sql string, args []any) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	b := &pgx.Batch{}
	c.queue(b)
	if sql != "" {
		b.Queue(sql, args...).Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	}
	// A duplicate's raise leaves the batch's statements prepared, the
	// handler's included (pgbatch).
	err := pgbatch.Run(ctx, conn, b)

	var pre pgx.ErrPreprocessingBatch
	if sql != "" && errors.As(err, &pre) && pre.SQL() == sql {
		// pgx prepares and encodes a batch before it sends any of it: the
		// handler's statement failed there, and nothing went out. The
		// claim goes alone, then the statement, whose error is the
		// handler's as ever.
		if _, err := c.send(ctx, conn, "", nil); err != nil || c.claimed == 0 {
			return tag, err
		}
		return conn.Exec(ctx, sql, args...)
	}
	c.settle(err)
	if c.claimed == 1 {
		// The claim holds; err, if any, is the handler's statement's.
		return tag, err
	}
	return tag, c.err
}

// fromRaise reads the stored outcome a claim's raise carries
// (idemsaga.key_held, migration 012): a JSON array of the outcome, the
// result, the error text and the attempt, in the error's COLUMN field,
// which the server log does not record.
func (st *stored) fromRaise(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	if pgErr.ColumnName == "" {
		return errors.New("the raise carries no stored outcome; apply the engine's migrations (worker migrate) before running this step worker")
	}
	var cols []json.RawMessage
	if err := json.Unmarshal([]byte(pgErr.ColumnName), &cols); err != nil || len(cols) != 4 {
		return fmt.Errorf("cannot read the stored outcome (%v); deploy the engine's migrations and step workers of one version", err)
	}
	if string(cols[1]) != "null" {
		st.result = []byte(cols[1])
	}
	if err := errors.Join(json.Unmarshal(cols[0], &st.outcome), json.Unmarshal(cols[2], &st.errText), json.Unmarshal(cols[3], &st.attempt)); err != nil {
		return fmt.Errorf("cannot read the stored outcome (%w); deploy the engine's migrations and step workers of one version", err)
	}
	return nil
}
