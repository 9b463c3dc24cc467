package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

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
	return cl.repair(ctx, id, "pause", SkipStep{}, r, false)
}

// pauseFn is Pause's work on a saga locked in tx.
func pauseFn(ctx context.Context) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		id := sg.ID
		if sg.Finished() {
			return fmt.Errorf("%w: saga %s is %q, finished; only a running saga can be paused", ErrStateForbids, id, sg.State)
		}
		paused, err := store.PauseSaga(ctx, tx.Conn(), id)
		if err != nil {
			return fmt.Errorf("idemsaga: pause saga %s: %w", id, err)
		}
		if !paused {
			return fmt.Errorf("%w: saga %s is paused already; resume it with `resume %s`", ErrStateForbids, id, id)
		}
		return nil
	}
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
	return cl.repair(ctx, id, "resume", SkipStep{}, r, false)
}

// resumeFn is Resume's work on a saga locked in tx.
func resumeFn(ctx context.Context) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		id := sg.ID
		resumed, err := store.ResumeSaga(ctx, tx.Conn(), id)
		if err != nil {
			return fmt.Errorf("idemsaga: resume saga %s: %w", id, err)
		}
		if !resumed {
			return fmt.Errorf("%w: saga %s is not paused", ErrStateForbids, id)
		}
		return nil
	}
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
	return cl.definitionRepair(ctx, definition, "pause", r)
}

// ResumeDefinition resumes a paused definition: each of its running sagas
// that is not paused on its own goes on as Resume makes one, with the
// attempts it had. A definition that is not paused is ErrStateForbids.
func (cl *Client) ResumeDefinition(ctx context.Context, definition string, r Repair) (DefinitionRepair, error) {
	return cl.definitionRepair(ctx, definition, "resume", r)
}

// PausedDefinitions lists the definitions paused as a whole.
func (cl *Client) PausedDefinitions(ctx context.Context) ([]PausedDefinition, error) {
	rows, err := cl.c.pool.Query(ctx, `select definition, paused_at, reason, requested_by, request_key from idemsaga.paused_definitions order by definition`)
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

func (cl *Client) definitionRepair(ctx context.Context, definition, op string, r Repair) (DefinitionRepair, error) {
	if err := cl.Check(ctx); err != nil {
		return DefinitionRepair{}, err
	}
	if _, err := cl.c.resolve(ctx, definition); err != nil {
		return DefinitionRepair{}, err
	}
	if r.Key == "" {
		r.Key = uuid.NewString()
	}
	if err := saga.CheckKey(r.Key); err != nil {
		return DefinitionRepair{}, err
	}
	sum := sha256.Sum256([]byte(op + "\x00" + r.Reason))
	res := DefinitionRepair{Definition: definition, Operation: op, Key: r.Key}
	tx, err := cl.c.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: %w", op, definition, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// The request's record goes in first: a concurrent request under the
	// same key waits on it, then finds it.
	var inserted bool
	if err := tx.QueryRow(ctx, store.InsertDefinitionRepair,
		definition, r.Key, op, sum[:], r.Reason, r.By).Scan(&inserted, &res.At); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: record the request: %w", op, definition, err)
	}
	if !inserted {
		var hash []byte
		if err := tx.QueryRow(ctx, `select request_hash, sagas, created_at from idemsaga.definition_repairs where definition = $1 and request_key = $2`,
			definition, r.Key).Scan(&hash, &res.Sagas, &res.At); err != nil {
			return res, fmt.Errorf("idemsaga: %s definition %q: read its repairs: %w", op, definition, err)
		}
		if !bytes.Equal(hash, sum[:]) {
			return res, fmt.Errorf("%w (definition %q, key %q)", ErrRepairKeyReused, definition, r.Key)
		}
		res.Replayed = true
		return res, nil
	}
	switch op {
	case "pause":
		tag, err := tx.Exec(ctx, store.PauseDefinition, definition, r.Key, r.Reason, r.By)
		if err != nil {
			return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
		}
		if tag.RowsAffected() == 0 {
			var since time.Time
			var by, why string
			if err := tx.QueryRow(ctx, `select paused_at, requested_by, reason from idemsaga.paused_definitions where definition = $1`, definition).Scan(&since, &by, &why); err != nil {
				return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
			}
			return res, fmt.Errorf("%w: definition %q is paused already, since %s by %q (%s); resume it with `resume --definition %s`",
				ErrStateForbids, definition, since.Format(time.RFC3339), by, why, definition)
		}
		if err := tx.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1 and finished_at is null`, definition).Scan(&res.Sagas); err != nil {
			return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
		}
	case "resume":
		var since time.Time
		err := tx.QueryRow(ctx, store.ResumeDefinition, definition).Scan(&since)
		if errors.Is(err, pgx.ErrNoRows) {
			return res, fmt.Errorf("%w: definition %q is not paused", ErrStateForbids, definition)
		}
		if err != nil {
			return res, fmt.Errorf("idemsaga: resume definition %q: %w", definition, err)
		}
		if err := tx.QueryRow(ctx, store.ResendDefinition, definition, since).Scan(&res.Sagas); err != nil {
			return res, fmt.Errorf("idemsaga: resume definition %q: %w", definition, err)
		}
	}
	if _, err := tx.Exec(ctx, store.CountDefinitionRepair, definition, r.Key, res.Sagas); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: record the request: %w", op, definition, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: %w", op, definition, err)
	}
	return res, nil
}

// loadPause reads whether sg is held, and its deadline.
func (cl *Client) loadPause(ctx context.Context, sg *saga.Instance) error {
	var own, def *time.Time
	if err := cl.c.pool.QueryRow(ctx, store.SelectPause, pguuid.Of(sg.ID)).Scan(&own, &def, &sg.DeadlineAt); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("idemsaga: read saga %s: %w", sg.ID, err)
	}
	sg.Paused = nil
	switch {
	case own != nil:
		sg.Paused = &saga.Pause{Since: *own}
	case def != nil:
		sg.Paused = &saga.Pause{Since: *def, Definition: sg.Definition}
	}
	return nil
}

// deadlineArg is the deadline parameter of store.StartSaga: the definition's in
// milliseconds, NULL for none.
func deadlineArg(def *saga.Definition) any {
	if def.Deadline() <= 0 {
		return nil
	}
	return def.Deadline().Milliseconds()
}
