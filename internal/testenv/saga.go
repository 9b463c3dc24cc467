package testenv

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// NewSaga writes a saga of definition def at its first step, as a start
// would without its command, and returns its id: for tests that drive a
// step worker by hand (the inbox's rows reference their saga).
func NewSaga(t testing.TB, pool *pgxpool.Pool, def string) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	_, err := pool.Exec(context.Background(), `insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state)
values ($1, $2, $3, '\x00', '{}', 'init')`, pguuid.Of(id), def, id.String())
	if err != nil {
		t.Fatalf("testenv: write a saga: %v", err)
	}
	return id
}

// Command is the command of attempt of step of saga sagaID, under its key.
func Command(sagaID uuid.UUID, def, step string, phase saga.Phase, attempt int, input any) wire.Command {
	raw, _ := json.Marshal(input)
	return wire.Command{SagaID: sagaID, Definition: def, Step: step, Phase: phase,
		Key: saga.StepKey(sagaID, step, phase), Attempt: attempt, Input: raw}
}
