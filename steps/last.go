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

// inOneTrip makes b, the batch l leads with the claim it carries, the
// whole transaction (claim.inOneTrip): the caller then queues no COMMIT.
// It reports false, changing nothing, when l carries no claim (the
// transaction began in an earlier round trip).
func (l *lastStatement) inOneTrip(b *pgx.Batch) bool {
	return l != nil && l.claim != nil && l.claim.inOneTrip(b)
}

// leads reports whether err, the error of a batch that l led, is l's own
// (or its claim's), so that the statements after it are not to be judged.
func (l *lastStatement) leads(err error) bool { return l != nil && err != nil && !l.ran }

// judge classifies err, the error of a batch that l led, when leads(err);
// gone reports that the attempt's context ended or its connection broke.
// A duplicate (the claim found the key taken) returns nil, with
// l.claim.claimed 0 and what the inbox holds in l.claim.st. The claim's
// own failure returns it (l.claim.err). An error PostgreSQL did not
// answer, on a connection gone or a context ended, is returned as it is:
// nothing committed, and the command is delivered again. Anything else
// (the statement failed, or pgx could not prepare or encode it) returns
// errLastFailed, and the handler runs again with the statement run at
// once, which reports that error to it.
func (l *lastStatement) judge(err error, gone bool) error {
	var pre pgx.ErrPreprocessingBatch
	if errors.As(err, &pre) {
		if pre.SQL() != l.sql {
			// One of the worker's own statements: nothing went out, and
			// a second run would fail the same way.
			return err
		}
		// The statement itself could not be prepared or encoded
		// (an undefined table, say): nothing went out, the claim
		// included, and the error is the handler's to judge.
		return fmt.Errorf("%w: %w", errLastFailed, err)
	}
	var pgErr *pgconn.PgError
	answered := errors.As(err, &pgErr)
	if !answered && (gone || pgconn.Timeout(err)) {
		return err
	}
	if answered && l.claim != nil && !l.claim.begun {
		l.claim.settle(err)
		if l.claim.err != nil {
			return l.claim.err
		}
		return nil // a duplicate
	}
	return fmt.Errorf("%w: %w", errLastFailed, err)
}
