package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Pause stops a running saga where it is, for a dependency that is down,
// say: no attempt of its steps starts until Resume. A command that
// arrives meanwhile is held (not run, its attempt not counted), the
// reaper neither dispatches its due retries nor takes over its expired
// leases, and its deadline does not fire. An attempt already running
// when the pause commits runs to its end and its outcome is recorded (a
// pause does not cut an external call); the step it leads to waits.
//
// Only a running saga can be paused; a finished one, or one paused
// already, is ErrStateForbids. The pause is recorded as a repair (who,
// when, why; Repair.Key makes it safe to send again).
func (cl *Client) Pause(ctx context.Context, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "pause", SkipStep{}, r, false)
}

// PauseTx is Pause in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) PauseTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "pause", SkipStep{}, r, false)
}

// Resume lets a paused saga go on where it stopped, with the attempts it
// had: each step in flight is sent again at its same attempt, with a
// fresh lease, and a retry that came due while paused is dispatched. The
// reaper of a process that runs the saga's definition does the sending,
// at its next pass; the resume itself is one transaction, so a crash
// after it loses nothing. A saga whose definition is paused too stays
// held until the definition is resumed.
//
// A saga that is not paused is ErrStateForbids. The resume is recorded as
// a repair.
func (cl *Client) Resume(ctx context.Context, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, nil, id, "resume", SkipStep{}, r, false)
}

// ResumeTx is Resume in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) ResumeTx(ctx context.Context, tx pgx.Tx, id uuid.UUID, r Repair) (RepairResult, error) {
	return cl.repair(ctx, tx, id, "resume", SkipStep{}, r, false)
}

// DefinitionRepair is what PauseDefinition or ResumeDefinition did.
type DefinitionRepair struct {
	// Definition is the definition's name.
	Definition string `json:"definition"`
	// Operation is "pause" or "resume".
	Operation string `json:"operation"`
	// Key is the request's key (Repair.Key, or the one made up for it).
	Key string `json:"key"`
	// Sagas is how many sagas of the definition were running when the
	// repair committed: held by a pause, sent on by a resume.
	Sagas int `json:"sagas"`
	// At is when the repair's transaction began, on the database clock.
	At time.Time `json:"at"`
	// Replayed is true when the key named a repair already done: nothing
	// was written, and the rest is that repair's.
	Replayed bool `json:"replayed"`
}

// PausedDefinition is a definition paused as a whole.
type PausedDefinition struct {
	Definition string    `json:"definition"`
	Since      time.Time `json:"since"`
	Reason     string    `json:"reason"`
	By         string    `json:"by"`
	Key        string    `json:"key"`
}

// PauseDefinition pauses every saga of a definition at once, as Pause
// does one: those running, and those started while it is paused, which
// are accepted and held (their first step waits). It is the bulk form of
// Pause, and costs one row however many sagas it holds. A definition
// paused already is ErrStateForbids. The pause is recorded, with who and
// why, in idemsaga.definition_repairs; Repair.Key makes it safe to send
// again.
func (cl *Client) PauseDefinition(ctx context.Context, definition string, r Repair) (DefinitionRepair, error) {
	return cl.definitionRepair(ctx, nil, definition, "pause", r)
}

// PauseDefinitionTx is PauseDefinition in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) PauseDefinitionTx(ctx context.Context, tx pgx.Tx, definition string, r Repair) (DefinitionRepair, error) {
	return cl.definitionRepair(ctx, tx, definition, "pause", r)
}

// definitionRepair pauses or resumes a definition, as op says, in tx if
// not nil.
func (cl *Client) definitionRepair(ctx context.Context, tx pgx.Tx, definition, op string, r Repair) (DefinitionRepair, error) {
	if err := cl.Check(ctx); err != nil {
		return DefinitionRepair{}, err
	}
	if _, err := cl.c.Resolve(ctx, definition); err != nil {
		return DefinitionRepair{}, err
	}
	res, err := cl.c.RepairDefinition(ctx, tx, definition, op, orchestrate.Request(r))
	return DefinitionRepair(res), err
}

// ResumeDefinition resumes a paused definition: each of its running sagas
// that is not paused on its own goes on as Resume makes one, with the
// attempts it had. A definition that is not paused is ErrStateForbids.
func (cl *Client) ResumeDefinition(ctx context.Context, definition string, r Repair) (DefinitionRepair, error) {
	return cl.definitionRepair(ctx, nil, definition, "resume", r)
}

// ResumeDefinitionTx is ResumeDefinition in the caller's transaction tx, as a savepoint in it:
// it takes effect when tx commits, and not at all if tx rolls back. See
// "Repairs in your transaction" in the package documentation.
func (cl *Client) ResumeDefinitionTx(ctx context.Context, tx pgx.Tx, definition string, r Repair) (DefinitionRepair, error) {
	return cl.definitionRepair(ctx, tx, definition, "resume", r)
}

// PausedDefinitions lists the definitions paused as a whole.
func (cl *Client) PausedDefinitions(ctx context.Context) ([]PausedDefinition, error) {
	rows, err := cl.c.DB().Query(ctx, `select definition, paused_at, reason, requested_by, request_key from idemsaga.paused_definitions order by definition`)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read the paused definitions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PausedDefinition, error) {
		var p PausedDefinition
		err := row.Scan(&p.Definition, &p.Since, &p.Reason, &p.By, &p.Key)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read the paused definitions: %w", err)
	}
	return out, nil
}

// loadPause reads whether sg is held, and its deadline.
func (cl *Client) loadPause(ctx context.Context, q querier, sg *saga.Instance) error {
	var own, def *time.Time
	if err := q.QueryRow(ctx, cl.c.Schema().SQL(store.SelectPause), pguuid.Of(sg.ID)).Scan(&own, &def, &sg.DeadlineAt); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("idemsaga: read saga %s: %w", sg.ID, err)
	}
	sg.Paused = nil
	switch {
	case sg.Finished():
		// A finished saga runs nothing more: no pause holds it, whatever
		// was paused before or after it finished.
	case own != nil:
		sg.Paused = &saga.Pause{Since: *own}
	case def != nil:
		sg.Paused = &saga.Pause{Since: *def, Definition: sg.Definition}
	}
	return nil
}
