package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// archiveReader reads the sagas the cleaner archives (RetentionConfig.
// ArchiveDir) as inspection shows them, with what their rows hold beyond
// that: one implementation of reading a saga, for show and archive alike.
type archiveReader struct{ cl *Client }

// ReadSagas reads sagas ids through tx, which holds their locks, one
// line per ID in the order given.
func (r archiveReader) ReadSagas(ctx context.Context, tx pgx.Tx, ids []uuid.UUID) ([]*saga.ArchivedSaga, error) {
	lines := make(map[uuid.UUID]*saga.ArchivedSaga, len(ids))
	rows, err := r.cl.c.Schema().Q(tx).Query(ctx, store.SelectArchiveSagas, ids)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: archive: read sagas: %w", err)
	}
	for rows.Next() {
		var id uuid.UUID
		a := &saga.ArchivedSaga{Format: saga.ArchiveFormat}
		if err := rows.Scan(&id, &a.InputHash, &a.TraceContext, &a.ArchivedAt); err != nil {
			rows.Close()
			return nil, fmt.Errorf("idemsaga: archive: read sagas: %w", err)
		}
		lines[id] = a
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("idemsaga: archive: read sagas: %w", err)
	}
	rows, err = r.cl.c.Schema().Q(tx).Query(ctx, store.SelectArchiveInbox, ids)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: archive: read inbox rows: %w", err)
	}
	for rows.Next() {
		var id uuid.UUID
		var in saga.InboxRecord
		var phase string
		if err := rows.Scan(&id, &in.StepKey, &in.Step, &phase, &in.Attempt, &in.Outcome, &in.Unknown, &in.Verified, &in.Result, &in.Error, &in.CreatedAt); err != nil {
			rows.Close()
			return nil, fmt.Errorf("idemsaga: archive: read inbox rows: %w", err)
		}
		in.Phase = saga.Phase(phase)
		if a := lines[id]; a != nil {
			a.Inbox = append(a.Inbox, in)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("idemsaga: archive: read inbox rows: %w", err)
	}
	descs := map[string]*saga.Description{}
	out := make([]*saga.ArchivedSaga, 0, len(ids))
	for _, id := range ids {
		a := lines[id]
		if a == nil {
			return nil, fmt.Errorf("idemsaga: archive: saga %s not found", id)
		}
		sg, err := store.LoadSaga(ctx, r.cl.c.Schema().Q(tx), id, false)
		if err != nil {
			return nil, fmt.Errorf("idemsaga: archive: read saga %s: %w", id, err)
		}
		if err := r.cl.loadSteps(ctx, tx, sg); err != nil {
			return nil, err
		}
		a.Saga = *sg
		if a.Description, err = r.description(ctx, descs, sg); err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// description is the recorded description of sg's definition version,
// nil when there is none; seen caches them for a batch.
func (r archiveReader) description(ctx context.Context, seen map[string]*saga.Description, sg *saga.Instance) (*saga.Description, error) {
	ref := saga.Ref(sg.Definition, sg.DefinitionVersion)
	if d, ok := seen[ref]; ok {
		return d, nil
	}
	def, err := r.cl.c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
	var d *saga.Description
	switch {
	case errors.Is(err, saga.ErrUnknownDefinition):
	case err != nil:
		return nil, fmt.Errorf("idemsaga: archive: read definition %s: %w", ref, err)
	default:
		desc := def.Describe()
		d = &desc
	}
	seen[ref] = d
	return d, nil
}
