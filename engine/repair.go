package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// ErrStateForbids is returned by a repair when the saga's state does not
// allow it, saying why and what to do. Nothing is written.
var ErrStateForbids = orchestrate.ErrStateForbids

// Retry runs a step again under its key, at its next attempt, from where
// the saga stopped or waits; what it does depends on the saga's state:
//
//   - StateFailed: the compensation that could not finish is dispatched
//     again at its next attempt, and the saga is compensating again.
//   - StateParked: the forward step that may have taken effect is
//     dispatched again at its next attempt, under its key, so the other
//     system answers with what it did; the saga is back where it was when
//     the step ran. It stays possibly done, so if it is given up again the
//     saga parks again.
//   - Running, its step (forward or compensation) waiting out a retry's
//     backoff: the next attempt is dispatched now rather than when due
//     ("retry now"), under the same key and fenced by the attempt, as the
//     reaper would.
//
// Everything else is refused with ErrStateForbids, saying why and what to
// do: a step running its attempt (its lease, when it runs out, brings the
// next one), a compensated saga (a forward step whose undo began or
// finished is never run again: the undo may have reached other systems;
// start a new saga with a new key), a completed saga, and a closed one.
//
// Use it after a person checked or repaired the other system. The step's
// failure or tombstone is cleared from the inbox in the same transaction,
// so the retried attempt runs; every other step key keeps its record, so
// nothing that took effect runs twice.
func (cl *Client) Retry(ctx context.Context, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "retry", SkipStep{}, r, false)
}

// RetryTx is Retry in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) RetryTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "retry", SkipStep{}, r, false)
}

// ErrUnknownRepair is returned for a repair operation the engine does not
// have. Nothing is written.
var ErrUnknownRepair = errors.New("idemsaga: unknown repair operation")

// Repairs names the repair operations Bulk and the HTTP API accept.
var Repairs = []string{"retry", "cancel", "skip", "close", "pause", "resume"}

// repair runs the repair named op on saga id (s is a skip's step), in tx
// if not nil, or, with dryRun, says what it would do and writes nothing.
func (cl *Client) repair(ctx context.Context, tx pgx.Tx, id uuid.UUID, op string, s SkipStep, r Repair, dryRun bool) (RepairResult, error) {
	if !slices.Contains(Repairs, op) {
		return RepairResult{}, fmt.Errorf("%w: %q; the repairs are %s", ErrUnknownRepair, op, strings.Join(Repairs, ", "))
	}
	if _, err := cl.resolveSaga(ctx, tx, id); err != nil {
		return RepairResult{}, err
	}
	res, err := cl.c.Repair(ctx, tx, id, op, orchestrate.Skip(s), orchestrate.Request(r), dryRun)
	return RepairResult(res), publicError(err)
}

// Cancel stops a saga and compensates what it completed.
//
// For a running saga that is not compensating, the step in flight is
// settled through the inbox first (a tombstone under its key, then what
// the inbox holds): if it took effect it counts as completed and is
// compensated too; if it may have (an external call whose outcome is
// unknown), it is compensated first, or the saga parks when it has no
// compensation; otherwise no late delivery can make it take effect.
//
// For a parked saga, the step that may have taken effect is taken as not
// having done so (a person checked the other system, or undid it by
// hand), and the steps before it are compensated.
//
// A saga already compensating or finished is refused.
func (cl *Client) Cancel(ctx context.Context, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "cancel", SkipStep{}, r, false)
}

// CancelTx is Cancel in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) CancelTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "cancel", SkipStep{}, r, false)
}

// Repair is an operator's request to repair a saga: Retry, Cancel, Skip
// or Close.
type Repair struct {
	// Key makes the request safe to send again: a second request with
	// the same key for the same saga changes nothing and answers with the
	// first one's result (Replayed set). The same key with another
	// operation or reason is ErrRepairKeyReused. Empty: a new key, so the
	// request is never taken for an earlier one.
	Key string
	// Reason says why, for the saga's error and the record.
	Reason string
	// By names who asked (a person, a tool), for the record.
	By string
}

// RepairResult is what a repair did.
type RepairResult struct {
	// ID is the saga's.
	ID uuid.UUID
	// Operation is "retry", "cancel", "skip" or "close".
	Operation string
	// Before is the saga's state when the repair began (for a replay,
	// its state when the request was answered again).
	Before saga.State
	// State is the saga's state right after the repair committed (for a
	// dry run: the state it would leave).
	State saga.State
	// Key is the request's key (Repair.Key, or the one made up for it).
	Key string
	// At is when the repair's transaction began, on the database clock.
	At time.Time
	// Replayed is true when the key named a repair already done: nothing
	// was written, and the rest is that repair's.
	Replayed bool
	// DryRun is true when nothing was written: the result is what the
	// repair would do (Bulk with DryRun).
	DryRun bool
}

// ErrStepInFlight is returned by Cancel while an external step's attempt
// is calling the other system: compensating it then would race the call.
// Cancel again once the attempt ended (StepInFlightError.Until at the
// latest, when its lease runs out). Nothing was written.
var ErrStepInFlight = orchestrate.ErrStepInFlight

// StepInFlightError is ErrStepInFlight with the attempt and its lease.
type StepInFlightError struct {
	SagaID  uuid.UUID
	Step    string
	Attempt int
	// Until is when the attempt's lease runs out, on the database clock.
	Until time.Time
}

func (e *StepInFlightError) Error() string { return (*orchestrate.StepInFlightError)(e).Error() }

func (e *StepInFlightError) Unwrap() error { return ErrStepInFlight }

// publicError gives the repairs' internal errors their public types.
func publicError(err error) error {
	var in *orchestrate.StepInFlightError
	if errors.As(err, &in) {
		return (*StepInFlightError)(in)
	}
	return err
}

// ErrRepairKeyReused is returned when a repair's key already names
// another request for the saga (another operation or reason). Nothing is
// written.
var ErrRepairKeyReused = orchestrate.ErrRepairKeyReused

// resolveSaga checks the client against the deployment, and returns the
// definition of saga id, loaded from its description when this process
// does not have its code, so that the repair can plan from it.
func (cl *Client) resolveSaga(ctx context.Context, tx pgx.Tx, id uuid.UUID) (*saga.Definition, error) {
	// A repair writes commands and leases as a start does.
	if err := cl.Check(ctx); err != nil {
		return nil, err
	}
	var def string
	var version int
	var q store.Row = cl.c.Pool()
	if tx != nil {
		// A saga the caller's transaction started is seen in it alone.
		q = tx
	}
	err := q.QueryRow(ctx, cl.c.Schema().SQL(`select definition, definition_version from idemsaga.sagas where id = $1`), pguuid.Of(id)).Scan(&def, &version)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s", saga.ErrNotFound, id)
	}
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read saga %s: %w", id, err)
	}
	return cl.c.DefinitionAt(ctx, def, version)
}
