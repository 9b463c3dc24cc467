package saga

import (
	"errors"
	"fmt"
	"time"
)

// ErrIdempotencyKeyReused is returned by Start when a saga with the same
// definition and idempotency key already exists but was started with a
// different input. Nothing is written. The caller must either resend the
// original input or pick a new key for a new business intent.
var ErrIdempotencyKeyReused = errors.New("idemsaga: idempotency key already used with a different input; resend the original input or use a new key")

// ErrNotFound is returned when a saga looked up by ID or key does not exist.
var ErrNotFound = errors.New("idemsaga: saga not found; check the ID or key and the definition name")

// ErrUnknownDefinition is returned when a saga names a definition that the
// engine was not configured with.
var ErrUnknownDefinition = errors.New("idemsaga: unknown saga definition; register it in the engine's Config.Definitions")

// ErrInvalidDefinition wraps every validation failure of a Definition.
var ErrInvalidDefinition = errors.New("idemsaga: invalid saga definition")

// ErrConflict is returned when a conditional transition found the saga or
// step moved elsewhere by a concurrent writer. It is retryable: re-read and
// decide again.
var ErrConflict = errors.New("idemsaga: concurrent transition; re-read and retry")

// ErrDuplicateDelivery is what the first statement of a TxOnly step's
// Forward returns when the inbox already holds the step's outcome (a
// success, a permanent failure, or a tombstone): the command was delivered
// again. The statement's effect is rolled back; the
// handler should return (any error will do), and the worker answers with
// the stored outcome.
var ErrDuplicateDelivery = errors.New("idemsaga: the inbox already holds this step's outcome (a duplicate delivery); return, and the stored outcome is the answer")

// permanentError marks an error that must not be retried.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: the step is not retried, and a forward
// step that fails permanently starts compensation of the steps completed
// before it. Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or any error it wraps, was marked with
// Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// retryAfterError asks for the next attempt no earlier than a given delay.
type retryAfterError struct {
	err   error
	delay time.Duration
}

func (e *retryAfterError) Error() string {
	return fmt.Sprintf("retry after %s: %v", e.delay, e.err)
}
func (e *retryAfterError) Unwrap() error { return e.err }

// RetryAfter marks err as retryable no earlier than d from now, overriding
// the policy's backoff for this attempt (for example when a downstream
// service answered 429 with a Retry-After header). The attempt still counts
// against MaxAttempts.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		err = errors.New("retry requested")
	}
	return &retryAfterError{err: err, delay: d}
}

// RetryDelay returns the delay requested with RetryAfter, if any.
func RetryDelay(err error) (time.Duration, bool) {
	var r *retryAfterError
	if errors.As(err, &r) {
		return r.delay, true
	}
	return 0, false
}

// DefinitionError describes one problem of a Definition. It wraps
// ErrInvalidDefinition.
type DefinitionError struct {
	Definition string
	Field      string
	Problem    string
}

func (e *DefinitionError) Error() string {
	return fmt.Sprintf("idemsaga: invalid saga definition %q: %s: %s", e.Definition, e.Field, e.Problem)
}

// Unwrap lets errors.Is(err, ErrInvalidDefinition) match.
func (e *DefinitionError) Unwrap() error { return ErrInvalidDefinition }
