package store

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrBusy is returned when a step key is held by a transaction still
// running (a step worker's attempt): the engine does not wait on it while
// it holds the saga, and decides again a moment later.
var ErrBusy = errors.New("idemsaga: the step's key is held by an attempt still running; try again in a moment")

// ErrInvariant is returned when a write the engine makes under a saga's
// row lock missed its row (idemsaga.invariant_broken): a bug, with nothing
// written.
var ErrInvariant = errors.New("idemsaga: an engine invariant is broken (a bug; nothing was written)")

// ErrNotMigrated is returned when a statement names a table or function
// the database lacks.
var ErrNotMigrated = errors.New("idemsaga: the database lacks the engine's tables or functions; apply the migrations (the runtime's `migrate` command, or migrations.Migrate)")

// Interpret translates the driver's errors the engine reasons about into
// its own, keeping the driver's error in the chain: it is the one place
// where SQLSTATEs are read.
func Interpret(err error) error {
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) {
		return err
	}
	switch pgErr.Code {
	case "IDM00":
		return fmt.Errorf("%w: %w", ErrInvariant, err)
	case "42P01", "3F000", "42883":
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	}
	return err
}

// IsSerialization reports a serialization failure or a deadlock
// (SQLSTATE 40001, 40P01): nothing was written, and the same work may be
// tried again.
func IsSerialization(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}
