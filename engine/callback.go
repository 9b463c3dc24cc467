package engine

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/saga"
)

// Callback is another system's answer to a CallbackStep's request.
type Callback struct {
	// Token names the step: StepContext.CallbackToken(), which the step's
	// request gave the other system. Required.
	Token string
	// EventID is the other system's own id for this event (a payment
	// channel's transaction number), the same in every delivery of it:
	// the first delivery decides, and every later one is answered from
	// its record. 1 to 255 printable ASCII characters. Required.
	EventID string
	// Result is the step's result, as JSON (empty for none).
	Result json.RawMessage
	// Error, if not empty, says the other system refused the request: the
	// step failed for good, without effect, and the saga compensates the
	// steps before it. Give Result or Error, not both.
	Error string
	// Body and Signature are the callback as delivered and its signature
	// (saga.CallbackSignatureHeader), checked against the definition's
	// secrets when it signs its callbacks (saga.WithCallbackSecrets)
	// before anything is written: a missing or wrong one is
	// saga.ErrCallbackSignature. Unused otherwise.
	Body      []byte
	Signature string
}

// Callback outcomes, CallbackResult.Outcome.
const (
	// CallbackApplied: the callback completed the step (it succeeded, or
	// failed when Callback.Error was given).
	CallbackApplied = orchestrate.CallbackApplied
	// CallbackPending: the step's request is not recorded yet (the answer
	// raced the request); the callback is applied when the step waits.
	CallbackPending = orchestrate.CallbackPending
	// CallbackLate: the step no longer waits (given up, cancelled,
	// compensated); the callback is recorded and changes nothing. A
	// person should look at the saga: the other system acted late.
	CallbackLate = orchestrate.CallbackLate
	// CallbackSuperseded: another event completed the step first; this
	// one is recorded and changes nothing.
	CallbackSuperseded = orchestrate.CallbackSuperseded
)

// CallbackResult is what a callback did.
type CallbackResult struct {
	SagaID  uuid.UUID
	Step    string
	EventID string
	// Outcome is CallbackApplied, CallbackPending, CallbackLate or
	// CallbackSuperseded: for a delivery of an event already received,
	// what that event did (a pending one may have been applied since).
	Outcome string
	// Detail says in a sentence what happened, for the other system's log.
	Detail string
	// State is the saga's state after the callback.
	State saga.State
	// ReceivedAt is when the event was first received, on the database
	// clock.
	ReceivedAt time.Time
	// Replayed is true when the event was received before: nothing was
	// written.
	Replayed bool
}

// ErrCallbackReused is returned for an event id already received with
// another body, or for another saga's step. Nothing is written.
var ErrCallbackReused = orchestrate.ErrCallbackReused

// ErrNotCallbackStep is returned by Complete for a token that names a
// step that is not a saga.CallbackStep. Nothing is written.
var ErrNotCallbackStep = orchestrate.ErrNotCallbackStep

// ErrInvalidCallback is returned by Complete for a callback that is
// malformed (an event id that breaks the key rules, a result that is not
// JSON, both a result and an error), or whose result the step's
// CheckCallback refused (saga.Step). Nothing is written.
var ErrInvalidCallback = orchestrate.ErrInvalidCallback

// Complete delivers a callback to the CallbackStep its token names, any
// number of times. The event id's first delivery decides, under a unique
// constraint and the saga's lock: it completes the step if the step
// waits; it is kept and applied when the step waits if the step's request
// is not recorded yet; and it is recorded as late, changing nothing, if
// the step no longer waits. Every later delivery of the event is answered
// from its record (Replayed); one with another body is ErrCallbackReused.
func (cl *Client) Complete(ctx context.Context, cb Callback) (CallbackResult, error) {
	return cl.complete(ctx, nil, cb)
}

// CompleteTx is Complete in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) CompleteTx(ctx context.Context, tx pgx.Tx, cb Callback) (CallbackResult, error) {
	return cl.complete(ctx, tx, cb)
}

// complete is Complete, in tx if not nil.
func (cl *Client) complete(ctx context.Context, tx pgx.Tx, cb Callback) (CallbackResult, error) {
	id, step, err := saga.ParseCallbackToken(cb.Token)
	if err != nil {
		return CallbackResult{}, err
	}
	if cb.EventID == "" {
		return CallbackResult{}, fmt.Errorf("%w: it has no event id; give the other system's own id for this event (its transaction or event number), the same in every delivery", ErrInvalidCallback)
	}
	if err := saga.CheckKey(cb.EventID); err != nil {
		return CallbackResult{}, fmt.Errorf("%w: event id %q: 1 to %d printable ASCII characters without surrounding spaces", ErrInvalidCallback, cb.EventID, saga.MaxKeyLength)
	}
	var result json.RawMessage
	switch {
	case cb.Error != "" && len(cb.Result) > 0:
		return CallbackResult{}, fmt.Errorf("%w: give a result or an error, not both", ErrInvalidCallback)
	case len(cb.Result) > 0:
		if result, err = saga.CanonicalInput(cb.Result); err != nil {
			return CallbackResult{}, fmt.Errorf("%w: result: %w", ErrInvalidCallback, err)
		}
		if max := cl.c.MaxResult(); max > 0 && len(result) > max {
			return CallbackResult{}, orchestrate.TooLarge("the callback's result", len(result), max)
		}
	}
	def, err := cl.resolveSaga(ctx, tx, id)
	if err != nil {
		return CallbackResult{}, err
	}
	if err := def.VerifyCallback(cb.Body, cb.Signature); err != nil {
		cl.c.Metrics().Callbacks.WithLabelValues(def.Name(), step, "refused").Inc()
		return CallbackResult{}, err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%t\x00%s\x00", cb.Error != "", cb.Error)
	h.Write(result)
	hash := h.Sum(nil)

	// Hashed as sent (a repeat compares so); kept sealed.
	if result, err = cl.c.Sealer().Seal(id, result); err != nil {
		return CallbackResult{}, err
	}
	res, err := cl.c.Complete(ctx, tx, id, step, orchestrate.Callback{EventID: cb.EventID, Error: cb.Error}, result, hash)
	if err != nil {
		return CallbackResult{}, err
	}
	return CallbackResult(res), nil
}
