package orchestrate

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/jackc/pgx/v5"
)

// pauseFn is Pause's work on a saga locked in tx.
func pauseFn(ctx context.Context) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		id := sg.ID
		if sg.Finished() {
			return fmt.Errorf("%w: saga %s is %q, finished; only a running saga can be paused", ErrStateForbids, id, sg.State)
		}
		paused, err := store.PauseSaga(ctx, tx.Schema().Q(tx.Conn()), id)
		if err != nil {
			return fmt.Errorf("idemsaga: pause saga %s: %w", id, err)
		}
		if !paused {
			return fmt.Errorf("%w: saga %s is paused already; resume it with `resume %s`", ErrStateForbids, id, id)
		}
		return nil
	}
}

// resumeFn is Resume's work on a saga locked in tx.
func resumeFn(ctx context.Context) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		id := sg.ID
		resumed, err := store.ResumeSaga(ctx, tx.Schema().Q(tx.Conn()), id)
		if err != nil {
			return fmt.Errorf("idemsaga: resume saga %s: %w", id, err)
		}
		if !resumed {
			return fmt.Errorf("%w: saga %s is not paused", ErrStateForbids, id)
		}
		return nil
	}
}

// RepairDefinition pauses or resumes a definition as op ("pause",
// "resume") says, recorded as r, in the caller's transaction in (nil: one
// of its own; in it, a savepoint).
func (c *Core) RepairDefinition(ctx context.Context, in pgx.Tx, definition, op string, r Request) (DefinitionResult, error) {
	if r.Key == "" {
		r.Key = uuid.NewString()
	}
	if err := saga.CheckKey(r.Key); err != nil {
		return DefinitionResult{}, err
	}
	sum := sha256.Sum256([]byte(op + "\x00" + r.Reason))
	res := DefinitionResult{Definition: definition, Operation: op, Key: r.Key}
	var tx pgx.Tx
	var err error
	if in != nil {
		tx, err = in.Begin(ctx)
	} else {
		tx, err = c.pool.Begin(ctx)
	}
	if err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: %w", op, definition, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// The request's record goes in first: a concurrent request under the
	// same key waits on it, then finds it.
	var inserted bool
	if err := c.schema.Q(tx).QueryRow(ctx, store.InsertDefinitionRepair,
		definition, r.Key, op, sum[:], r.Reason, r.By).Scan(&inserted, &res.At); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: record the request: %w", op, definition, err)
	}
	if !inserted {
		var hash []byte
		if err := c.schema.Q(tx).QueryRow(ctx, `select request_hash, sagas, created_at from idemsaga.definition_repairs where definition = $1 and request_key = $2`,
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
		tag, err := c.schema.Q(tx).Exec(ctx, store.PauseDefinition, definition, r.Key, r.Reason, r.By)
		if err != nil {
			return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
		}
		if tag.RowsAffected() == 0 {
			var since time.Time
			var by, why string
			if err := c.schema.Q(tx).QueryRow(ctx, `select paused_at, requested_by, reason from idemsaga.paused_definitions where definition = $1`, definition).Scan(&since, &by, &why); err != nil {
				return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
			}
			return res, fmt.Errorf("%w: definition %q is paused already, since %s by %q (%s); resume it with `resume --definition %s`",
				ErrStateForbids, definition, since.Format(time.RFC3339), by, why, definition)
		}
		if err := c.schema.Q(tx).QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1 and finished_at is null`, definition).Scan(&res.Sagas); err != nil {
			return res, fmt.Errorf("idemsaga: pause definition %q: %w", definition, err)
		}
	case "resume":
		var since time.Time
		err := c.schema.Q(tx).QueryRow(ctx, store.ResumeDefinition, definition).Scan(&since)
		if errors.Is(err, pgx.ErrNoRows) {
			return res, fmt.Errorf("%w: definition %q is not paused", ErrStateForbids, definition)
		}
		if err != nil {
			return res, fmt.Errorf("idemsaga: resume definition %q: %w", definition, err)
		}
		if err := c.schema.Q(tx).QueryRow(ctx, store.ResendDefinition, definition, since).Scan(&res.Sagas); err != nil {
			return res, fmt.Errorf("idemsaga: resume definition %q: %w", definition, err)
		}
	}
	if _, err := c.schema.Q(tx).Exec(ctx, store.CountDefinitionRepair, definition, r.Key, res.Sagas); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: record the request: %w", op, definition, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("idemsaga: %s definition %q: %w", op, definition, err)
	}
	return res, nil
}
