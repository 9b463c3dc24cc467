package steps

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// lastStatement is a handler's last statement held back by ExecLast
// (saga.StepContext.ExecLast): it leads the batch that records the step's
// success and commits, after the step's claim and BEGIN when nothing went
// before it, so that a step whose effect is that statement costs one round
// trip. Its row count is never seen: a statement that cannot take effect
// must fail, and then nothing of the attempt commits and the handler runs
// again with the statement at once (errLastFailed).
type lastStatement struct {
	sql  string
	args []any
	// claim is the step's claim, when the statement carries it (nothing
	// went before); nil when it went before.
	claim *claim
	// ran is set once the statement ran.
	ran bool
}

// errLastFailed marks an attempt whose held-back last statement failed, or
// could not be sent: nothing of it committed, and the worker runs the
// handler again at once, with the statement run at once, whose error the
// handler then judges.
var errLastFailed = errors.New("the step's last statement failed in the round trip of its success")

// batch returns a new batch led by the statement, and by the claim and
// BEGIN if it carries them; for a nil l, an empty batch.
func (l *lastStatement) batch() *pgx.Batch {
	b := &pgx.Batch{}
	if l == nil {
		return b
	}
	if l.claim != nil {
		l.claim.queue(b)
	}
	l.ran = false
	b.Queue(l.sql, l.args...).Exec(func(pgconn.CommandTag) error { l.ran = true; return nil })
	return b
}

// leads reports whether err, the error of a batch that l led, is l's own
// (or its claim's), so that the statements after it are not to be judged.
func (l *lastStatement) leads(err error) bool { return l != nil && err != nil && !l.ran }

// judge classifies err, the error of a batch that l led, when leads(err).
// A duplicate (the claim found the key taken) returns nil, with
// l.claim.claimed 0 and what the inbox holds in l.claim.st. The claim's
// own failure returns it (l.claim.err). Anything else means the statement
// failed or nothing was sent; it returns errLastFailed.
func (l *lastStatement) judge(err error) error {
	var pre pgx.ErrPreprocessingBatch
	if errors.As(err, &pre) {
		// pgx prepares and encodes a batch before it sends any of it:
		// nothing went out.
		return fmt.Errorf("%w: %w", errLastFailed, err)
	}
	if l.claim != nil {
		l.claim.settle(err)
		switch {
		case l.claim.err != nil:
			return l.claim.err
		case l.claim.claimed == 0:
			return nil
		}
	}
	return fmt.Errorf("%w: %w", errLastFailed, err)
}
