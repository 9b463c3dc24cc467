// Package pgbatch sends pgx batches whose statements may fail by design:
// the engine's fenced writes raise through idemsaga.expect (migration 004)
// when a saga or step moved, or a step key was taken, and the caller
// handles that. pgx drops every statement of a batch that failed from its
// statement cache and prepares them again on their next use, two round
// trips more, in case the failure came from a stale statement; a raise of
// ours never does, so Run keeps them.
package pgbatch

import (
	"context"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sender is what sends a batch: a connection or a transaction.
type Sender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Run sends b and reads its results in order, running each statement's
// callback as BatchResults.Close would, and returns the first error. When
// that error is a raise of idemsaga.expect (Raised), the batch's
// statements stay in pgx's cache.
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
	if Raised(err) {
		// Close goes through QueuedQueries to invalidate them; it has
		// nothing left to run.
		b.QueuedQueries = nil
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// Raised reports whether err is, or wraps, an error raised by
// idemsaga.expect: its SQLSTATEs are IDM01 to IDM03.
func Raised(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "IDM")
}
