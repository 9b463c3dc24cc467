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
var ErrNotFound = errors.New("idemsaga: saga not found; check its ID or idempotency key (list shows the sagas there are)")

// ErrUnknownDefinition is returned when a saga names a definition that the
// engine was not configured with.
var ErrUnknownDefinition = errors.New("idemsaga: unknown saga definition; register it in the engine's Config.Definitions")

// ErrInvalidDefinition wraps every validation failure of a Definition.
var ErrInvalidDefinition = errors.New("idemsaga: invalid saga definition")

// ErrConflict is returned when a conditional transition found the saga or
// step moved elsewhere by a concurrent writer. It is retryable: re-read and
// decide again.
var ErrConflict = errors.New("idemsaga: concurrent transition; re-read and retry")

// ErrLeaseLost is returned by StepContext.Heartbeat when the attempt no
// longer holds its step: a later attempt took it over after its lease
// ran out, or the engine gave the step up or the saga was repaired. The
// handler should stop and return; what it returns is not recorded.
var ErrLeaseLost = errors.New("idemsaga: the attempt's lease is lost (a later attempt took the step over, or it was given up); stop and return: nothing this attempt returns is recorded")

// permanentError marks an error that must not be retried.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: the step is not retried, and a forward
// step that fails permanently starts compensation of the steps completed
// before it. In an ExternalStep it also says that the other system answered
// and did not act (a declined card, say): the attempt's outcome is known.
// Permanent(nil) returns nil.
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

// notAppliedError marks an external call that is known not to have taken
// effect.
type notAppliedError struct{ err error }

func (e *notAppliedError) Error() string { return e.err.Error() }
func (e *notAppliedError) Unwrap() error { return e.err }

// NotApplied marks err, returned by an ExternalStep's handler, as the
// other system's answer that it did not act on this attempt (a 503 or a
// 429 it documents as "not processed", a validation refusal worth
// retrying): the attempt failed with a known outcome and is retried under
// the step's policy. Without it, an error of an ExternalStep leaves the
// attempt's outcome unknown, and the step possibly done. In a DatabaseStep
// every failed attempt is known not to have taken effect, and NotApplied
// changes nothing. NotApplied(nil) returns nil.
func NotApplied(err error) error {
	if err == nil {
		return nil
	}
	return &notAppliedError{err: err}
}

// IsNotApplied reports whether err, or any error it wraps, was marked with
// NotApplied.
func IsNotApplied(err error) bool {
	var n *notAppliedError
	return errors.As(err, &n)
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

// ErrResultTooLarge is a step's, a skip's or a callback's result over the
// deployment's bound (the engine's Config.MaxResultBytes): commands carry
// the results of the steps before theirs, and the saga's row keeps them
// all. Keep large data in a table of your own and return its id.
var ErrResultTooLarge = errors.New("idemsaga: step result too large")
