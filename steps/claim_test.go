package steps_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestTxOnlyClaimTravelsWithTheFirstStatement runs TxOnly steps whose
// handlers begin in every way a handler can: a statement that can share the
// claim's round trip, one that cannot (a query, a statement without
// arguments), no statement at all, and one that ignores the duplicate
// error. Each runs once with effect; delivered again to another worker (no
// remembered answer), it is answered from the inbox, its first statement
// fails with ErrDuplicateDelivery, and nothing it wrote survives.
func TestTxOnlyClaimTravelsWithTheFirstStatement(t *testing.T) {
	t.Parallel()
	insert := func(ctx context.Context, sc *saga.StepContext) error {
		_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, $2)`, sc.SagaID, sc.Step)
		return err
	}
	for _, tc := range []struct {
		name string
		// first is the handler's opening; its error is the first
		// statement's.
		first func(ctx context.Context, sc *saga.StepContext) error
		// effects is how many rows one run writes.
		effects int
		// ignoreDuplicate makes the handler return success whatever its
		// statements answered.
		ignoreDuplicate bool
	}{
		{name: "exec with arguments", first: insert, effects: 1},
		{name: "query first", first: func(ctx context.Context, sc *saga.StepContext) error {
			var n int
			if err := sc.Tx.QueryRow(ctx, `select count(*) from effects where saga_id = $1`, sc.SagaID).Scan(&n); err != nil {
				return err
			}
			return insert(ctx, sc)
		}, effects: 1},
		{name: "exec without arguments", first: func(ctx context.Context, sc *saga.StepContext) error {
			if _, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values (gen_random_uuid(), 'no-args')`); err != nil {
				return err
			}
			return insert(ctx, sc)
		}, effects: 2},
		{name: "no statement", first: func(context.Context, *saga.StepContext) error { return nil }, effects: 0},
		{name: "duplicate ignored", first: insert, effects: 1, ignoreDuplicate: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			_, err := pool.Exec(ctx, `create table effects (saga_id uuid not null, step text not null)`)
			require.NoError(t, err)
			var runs atomic.Int32
			var firstErrs []error
			def := saga.MustNew("txonly", saga.Step{
				Name: "write", Reaches: "written", TxOnly: true,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					runs.Add(1)
					err := tc.first(ctx, sc)
					firstErrs = append(firstErrs, err)
					if err != nil && !tc.ignoreDuplicate {
						return nil, fmt.Errorf("write: %w", err)
					}
					return json.RawMessage(`{"ok":true}`), nil
				},
			})
			id := uuid.New()
			cmd := command(id, "txonly", "write", saga.PhaseForward, 1, map[string]int{"n": 1})

			reply, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.False(t, reply.Duplicate)
			require.JSONEq(t, `{"ok":true}`, string(reply.Result))
			require.NoError(t, firstErrs[0])
			require.Equal(t, tc.effects, countEffects(t, pool))

			again, err := newWorker(t, pool, def).Handle(ctx, cmd)
			require.NoError(t, err)
			require.True(t, again.Duplicate, "the inbox answers")
			require.JSONEq(t, `{"ok":true}`, string(again.Result))
			require.Equal(t, tc.effects, countEffects(t, pool), "the duplicate's writes are rolled back")
			require.Equal(t, int32(2), runs.Load(), "a TxOnly handler runs up to its first statement")
			if tc.effects > 0 {
				require.ErrorIs(t, firstErrs[1], saga.ErrDuplicateDelivery)
			}
			var inbox, replies int
			require.NoError(t, pool.QueryRow(ctx, `select
  (select count(*) from idemsaga.inbox where saga_id = $1),
  (select count(*) from idemsaga.outbox where saga_id = $1)`, id).Scan(&inbox, &replies))
			require.Equal(t, []int{1, 1}, []int{inbox, replies}, "one inbox row, one reply")
		})
	}
}

// TestTxOnlyAnotherAttemptIsAnsweredWithAReply: a delivery of another
// attempt of a TxOnly step that already took effect rolls back what its
// first statement did, then answers that attempt with a reply in a
// transaction of its own.
func TestTxOnlyAnotherAttemptIsAnsweredWithAReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid not null, step text not null)`)
	require.NoError(t, err)
	def := saga.MustNew("txonly", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, $2)`, sc.SagaID, sc.Step)
			return nil, err
		},
	})
	id := uuid.New()
	_, err = newWorker(t, pool, def).Handle(ctx, command(id, "txonly", "write", saga.PhaseForward, 1, 1))
	require.NoError(t, err)
	reply, err := newWorker(t, pool, def).Handle(ctx, command(id, "txonly", "write", saga.PhaseForward, 2, 1))
	require.NoError(t, err)
	require.True(t, reply.Duplicate)
	require.Equal(t, 2, reply.Attempt)
	require.Equal(t, 1, countEffects(t, pool))
	var replies int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where saga_id = $1`, id).Scan(&replies))
	require.Equal(t, 2, replies, "attempt 1's reply and attempt 2's")
}

func countEffects(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from effects`).Scan(&n))
	return n
}

// withoutTxOnly returns def with every step's claim sent before its
// handler.
func withoutTxOnly(t *testing.T, def *saga.Definition) *saga.Definition {
	t.Helper()
	all := def.Steps()
	for i := range all {
		all[i].TxOnly = false
	}
	d, err := saga.New(def.Name(), all...)
	require.NoError(t, err)
	return d
}

// TestTxOnlyDuplicateKeepsTheHandlersStatementPrepared: a duplicate's claim
// fails by design before the handler's first statement runs, and that
// statement stays prepared on the connection (pgx would otherwise drop it
// with the failed batch and prepare it again, two round trips more per
// duplicate).
func TestTxOnlyDuplicateKeepsTheHandlersStatementPrepared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	_, err := shared.Exec(ctx, `create table effects (saga_id uuid not null, step text not null)`)
	require.NoError(t, err)
	cfg := shared.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	const insert = `insert into effects (saga_id, step) values ($1, $2)`
	def := saga.MustNew("txonly", saga.Step{
		Name: "write", Reaches: "written", TxOnly: true,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			_, err := sc.Tx.Exec(ctx, insert, sc.SagaID, sc.Step)
			return nil, err
		},
	})
	cmd := command(uuid.New(), "txonly", "write", saga.PhaseForward, 1, 1)
	prepared := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from pg_prepared_statements where statement = $1`, insert).Scan(&n))
		return n
	}
	_, err = newWorker(t, pool, def).Handle(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, 1, prepared())
	reply, err := newWorker(t, pool, def).Handle(ctx, cmd)
	require.NoError(t, err)
	require.True(t, reply.Duplicate)
	require.Equal(t, 1, prepared(), "the handler's statement is still prepared")
	require.Equal(t, 1, countEffects(t, pool))
}
