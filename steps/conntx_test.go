package steps_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestHandlerTransaction checks the transaction a handler receives: its
// writes commit with the reply, a savepoint rolls back alone, the handler
// cannot end the transaction itself, and the Tx is closed once the step is.
func TestHandlerTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `create table notes (id int primary key, body text not null)`)
	require.NoError(t, err)

	var kept pgx.Tx
	var commitErr, rollbackErr error
	def := saga.MustNew("notes", saga.Step{
		Name: "write", Reaches: "written",
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			kept = sc.Tx
			if _, err := sc.Tx.Exec(ctx, `insert into notes values (1, 'kept')`); err != nil {
				return nil, err
			}
			sp, err := sc.Tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := sp.Exec(ctx, `insert into notes values (2, 'rolled back')`); err != nil {
				return nil, err
			}
			if err := sp.Rollback(ctx); err != nil {
				return nil, err
			}
			if _, err := sp.Exec(ctx, `insert into notes values (5, 'after its rollback')`); !errors.Is(err, pgx.ErrTxClosed) {
				return nil, fmt.Errorf("a savepoint used after its rollback: %v", err)
			}
			sp2, err := sc.Tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := sp2.Exec(ctx, `insert into notes values (3, 'released')`); err != nil {
				return nil, err
			}
			if err := sp2.Commit(ctx); err != nil {
				return nil, err
			}
			commitErr, rollbackErr = sc.Tx.Commit(ctx), sc.Tx.Rollback(ctx)
			var n int
			if err := sc.Tx.QueryRow(ctx, `select count(*) from notes`).Scan(&n); err != nil {
				return nil, err
			}
			return json.Marshal(n)
		},
	})
	w := newWorker(t, pool, def)
	id := uuid.New()
	reply, err := w.Handle(ctx, wire.Command{SagaID: id, Definition: "notes", Step: "write", Phase: saga.PhaseForward,
		Key: saga.StepKey(id, "write", saga.PhaseForward), Attempt: 1, Input: json.RawMessage(`{}`)})
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.JSONEq(t, `2`, string(reply.Result), "the handler saw its own writes, without the rolled-back savepoint")

	require.Error(t, commitErr, "a handler cannot commit the step's transaction")
	require.Error(t, rollbackErr, "a handler cannot roll back the step's transaction")

	rows, err := pool.Query(ctx, `select id from notes order by id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	require.Equal(t, []int{1, 3}, ids)

	var outcome string
	require.NoError(t, pool.QueryRow(ctx, `select outcome from idemsaga.inbox where step_key = $1`, saga.StepKey(id, "write", saga.PhaseForward)).Scan(&outcome))
	require.Equal(t, "succeeded", outcome, "the inbox record committed with the writes")

	_, err = kept.Exec(ctx, `insert into notes values (4, 'too late')`)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "a Tx kept past its step is closed")
}
