package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/saga"
)

// Row reads one row: a pool, a connection or a transaction.
type Row interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ScanSaga reads a saga from a row of SelectSagaByID's columns; no row is
// saga.ErrNotFound.
func ScanSaga(row pgx.Row) (*saga.Instance, error) {
	var s saga.Instance
	var state string
	var results map[string]json.RawMessage
	err := row.Scan(&s.ID, &s.Definition, &s.Key, &state, &s.Version, &s.Input, &results, &s.Error,
		&s.CreatedAt, &s.UpdatedAt, &s.FinishedAt, &s.DefinitionVersion, &s.Skipped, &s.Parent, &s.ParentStep)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, saga.ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("read saga: %w", err)
	}
	s.State, s.Results = saga.State(state), results
	if len(s.Skipped) == 0 {
		s.Skipped = nil
	}
	return &s, nil
}

// LoadSaga reads saga id; lock takes its lock (SelectSagaByIDLocked).
func LoadSaga(ctx context.Context, q Row, id uuid.UUID, lock bool) (*saga.Instance, error) {
	sql := SelectSagaByID
	if lock {
		sql = SelectSagaByIDLocked
	}
	return ScanSaga(q.QueryRow(ctx, sql, pguuid.Of(id)))
}
