package engine

import (
	"context"
	"encoding/json"

	"github.com/google/uuid"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/jackc/pgx/v5"
)

// SkipStep names the step Skip marks succeeded, and its result.
type SkipStep struct {
	// Step names the step to skip. It must be the saga's step in flight,
	// or the step it parked or failed on: a saga that moved on meanwhile
	// is refused rather than another step skipped.
	Step string
	// Result is the step's result as JSON, what later steps read as its
	// result and the saga's results hold. Empty means null. It is
	// decoded strictly (one value, each member name once).
	Result json.RawMessage
}

// ErrInvalidResult is returned by Skip for a result that is not one JSON
// value. Nothing is written.
var ErrInvalidResult = orchestrate.ErrInvalidResult

// ErrResultTooLarge is returned by Skip and Complete for a result over
// Config.MaxResultBytes. Nothing is written.
var ErrResultTooLarge = orchestrate.ErrResultTooLarge

// Skip marks a step succeeded with the result an operator gives, and the
// saga goes on from it: the next step is dispatched, or the saga
// completes. For a compensation, the undo is taken as done (a person
// undid it by hand) and the next compensation runs, or the saga ends
// compensated. Which step it is depends on the saga's state:
//
//   - Running: its step in flight (retrying, or an attempt running). The
//     step's key is fenced first (a tombstone in the inbox, as a cancel
//     does), so no delivery of an earlier attempt can take effect after
//     the skip. If the step did take effect meanwhile, its own result is
//     applied instead and the skip is refused (ErrStateForbids). An
//     external step calling the other system is waited for, then refused
//     with a StepInFlightError: skipping it would race the call.
//   - StateParked: the forward step that may have taken effect (a person
//     checked the other system, and it did).
//   - StateFailed: the compensation that could not finish (a person
//     undid its step by hand).
//
// The skipped step's key keeps its inbox record (a tombstone, or the
// failure), so a late delivery of any earlier attempt is answered from it
// and changes nothing. The skip ends an attempt of its own, shown in the
// timeline as succeeded with "skipped by an operator", and is recorded
// with the step's name in the saga's repairs. A step skipped forward is
// compensated like any succeeded step if a later one fails.
func (cl *Client) Skip(ctx context.Context, id uuid.UUID, s SkipStep, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "skip", s, r, false)
}

// SkipTx is Skip in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) SkipTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, s SkipStep, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "skip", s, r, false)
}

// Close closes a failed or parked saga as handled: a person repaired or
// accepted what its steps left (the compensation that could not finish,
// the step that may have taken effect), and nothing is to run for it any
// more. The saga ends in saga.StateClosed, its error kept, with who and
// why in its repairs. Nothing is dispatched; every step key keeps its
// inbox record, so a late delivery for it changes nothing. Any other
// state is refused with ErrStateForbids: a running saga is cancelled
// (Cancel), a completed or compensated one needs nothing.
func (cl *Client) Close(ctx context.Context, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "close", SkipStep{}, r, false)
}

// CloseTx is Close in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) CloseTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "close", SkipStep{}, r, false)
}
