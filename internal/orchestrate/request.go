package orchestrate

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Request is an operator's repair as the engine's Client took it
// (engine.Repair).
type Request struct {
	Key, Reason, By string
}

// Result is what a repair did (engine.RepairResult).
type Result struct {
	ID               uuid.UUID
	Operation        string
	Before, State    saga.State
	Key              string
	At               time.Time
	Replayed, DryRun bool
}

// Skip is a skip's step and the result it is given (engine.SkipStep).
type Skip struct {
	Step   string
	Result json.RawMessage
}

// DefinitionResult is what a definition's pause or resume did
// (engine.DefinitionRepair).
type DefinitionResult struct {
	Definition, Operation, Key string
	Sagas                      int
	At                         time.Time
	Replayed                   bool
}

// Repair runs the repair named op (one of the engine's Repairs) on saga
// id, whose definition the caller resolved (s is a skip's step), in the
// caller's transaction in (nil: one of its own), or, with dryRun, says what it would do and writes nothing. The caller refuses an
// op the engine does not have, with what the repairs are.
func (c *Core) Repair(ctx context.Context, in pgx.Tx, id uuid.UUID, op string, s Skip, r Request, dryRun bool) (Result, error) {
	rop := repairOp{name: op, r: r, dryRun: dryRun}
	var fn func(tx *store.Tx, sg *saga.Instance) error
	var after func()
	switch op {
	case "retry":
		fn = c.retryFn(ctx)
	case "cancel":
		fx := &effects{}
		rop.notDone = new(string)
		fn, after = c.cancelFn(ctx, operatorCancel(r), &fx, rop.notDone), func() { c.emit(fx) }
	case "skip":
		var err error
		if rop, err = skipOp(s, r, c.maxResult); err != nil {
			return Result{}, err
		}
		rop.dryRun = dryRun
		fx := &effects{}
		fn, after = c.skipFn(ctx, s, r, rop.phase, &fx), func() { c.emit(fx) }
	case "close":
		closed := &store.Move{}
		fn, after = closeFn(ctx, closed), func() { c.Moved(closed, time.Time{}) }
	case "pause":
		fn = pauseFn(ctx)
	case "resume":
		fn = resumeFn(ctx)
	default:
		return Result{}, fmt.Errorf("idemsaga: unknown repair operation %q", op)
	}
	return c.recorded(ctx, in, id, rop, fn, after)
}
