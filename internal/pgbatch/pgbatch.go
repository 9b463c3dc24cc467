// Package pgbatch sends pgx batches whose statements may fail by design:
// the engine's fenced writes raise through idemsaga.expect (migration 004)
// when a saga or step moved, or a step key was taken, and the caller
// handles that; a step's last statement raises when it cannot take effect
// (saga.StepContext.ExecLast). pgx drops every statement of a batch that
// failed from its statement cache and prepares them again on their next
// use, two round trips more (and a transaction each, in PostgreSQL's
// count), in case the failure came from a stale statement. Run keeps them
// unless the error is of a kind a stale statement can give.
package pgbatch

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sender is what sends a batch: a connection or a transaction.
type Sender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// ErrAtSync marks the error of a batch whose statements all ran, and
// which failed after them, at its Sync: where PostgreSQL commits a batch
// that is an implicit transaction (a deferred constraint, a serialization
// failure), or a connection that broke there.
var ErrAtSync = errors.New("the batch failed after its last statement, at its end")

// Run sends b and reads its results in order, running each statement's
// callback as BatchResults.Close would, and returns the first error; an
// error after every statement ran wraps ErrAtSync. The batch's statements
// stay in pgx's cache unless a statement's error is one a stale statement
// can give (keeps). Once it ran, b holds no statements.
func Run(ctx context.Context, s Sender, b *pgx.Batch) error {
	br := s.SendBatch(ctx, b)
	var err error
	for _, q := range b.QueuedQueries {
		if q.Fn != nil {
			err = q.Fn(br)
		} else {
			_, err = br.Exec()
		}
		if err != nil {
			break
		}
	}
	if err == nil || keeps(err) {
		// Close goes through QueuedQueries to invalidate them; it has
		// nothing left to run. When every statement ran, an error at the
		// end is not a stale statement's.
		b.QueuedQueries = nil
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%w: %w", ErrAtSync, cerr)
	}
	return err
}

// Raised reports whether err is, or wraps, an error raised by
// idemsaga.expect: its SQLSTATEs are IDM01 to IDM03.
func Raised(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "IDM")
}

// keeps reports whether err, an error PostgreSQL answered a batch with,
// leaves the batch's prepared statements valid: every error but those of
// the classes a statement prepared before a change of schema or settings
// can give (connection exception; feature not supported, as in "cached
// plan must not change result type"; data exception, as an argument sent
// in the parameter type of a column whose type changed since; invalid
// statement name; invalid catalog or schema name; syntax error or access
// rule violation, which holds undefined tables, columns and functions;
// internal error). Raises (idemsaga.expect, a handler's own), constraint
// violations, serialization failures and lock timeouts are kept.
func keeps(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 {
		return false
	}
	switch pgErr.Code[:2] {
	case "08", "0A", "22", "26", "3D", "3F", "42", "XX":
		return false
	}
	return true
}
