package engine

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

func TestTransitionZeroRowCases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	cl, err := NewClient(Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition}})
	require.NoError(t, err)
	res, err := cl.Start(ctx, transfer.Definition, "k1", transfer.Input{From: 1, To: 2, Amount: 5})
	require.NoError(t, err)
	c := cl.c

	// Each transition is queued and checked when the transaction commits.
	inTx := func(fn func(tx *txn) error) error {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		q := newTxn(tx)
		if err := fn(q); err != nil {
			return err
		}
		return q.commit(ctx)
	}
	snapshot := func() *saga.Instance {
		sg, err := loadSaga(ctx, pool, res.ID, false)
		require.NoError(t, err)
		return sg
	}

	// Applied: init -> deducted at version 1.
	stale := snapshot()
	require.Equal(t, saga.StateInit, stale.State)
	require.EqualValues(t, 1, stale.Version)
	sg := snapshot()
	require.NoError(t, inTx(func(tx *txn) error {
		return c.transition(tx, sg, transfer.StateDeducted, false, nil, nil, nil, &effects{})
	}))
	require.EqualValues(t, 2, sg.Version)
	require.Equal(t, transfer.StateDeducted, snapshot().State)

	// Already applied: the same move from the stale snapshot touches no
	// row and is recognised as a duplicate.
	dup := *stale
	err = inTx(func(tx *txn) error {
		return c.transition(tx, &dup, transfer.StateDeducted, false, nil, nil, nil, &effects{})
	})
	require.ErrorIs(t, err, errAlreadyApplied)

	// Conflict: another move from the stale snapshot finds the saga moved.
	conflict := *stale
	err = inTx(func(tx *txn) error {
		return c.transition(tx, &conflict, saga.StateCompensating, false, nil, nil, nil, &effects{})
	})
	require.ErrorIs(t, err, saga.ErrConflict)
	require.Equal(t, transfer.StateDeducted, snapshot().State, "a conflicting move changes nothing")
	require.EqualValues(t, 2, snapshot().Version)

	// Missing: no such saga.
	ghost := *stale
	ghost.ID = uuid.New()
	err = inTx(func(tx *txn) error {
		return c.transition(tx, &ghost, transfer.StateDeducted, false, nil, nil, nil, &effects{})
	})
	require.ErrorIs(t, err, saga.ErrNotFound)

	// A move the state graph forbids is refused before touching the row.
	back := snapshot()
	err = inTx(func(tx *txn) error {
		return c.transition(tx, back, saga.StateInit, false, nil, nil, nil, &effects{})
	})
	require.Error(t, err)
	require.False(t, errors.Is(err, errAlreadyApplied))
	require.EqualValues(t, 2, snapshot().Version)
}

func TestJudge(t *testing.T) {
	t.Parallel()
	r := func(attempt int) wire.Reply { return wire.Reply{Attempt: attempt} }
	cases := []struct {
		name  string
		row   stepRow
		reply wire.Reply
		want  Verdict
	}{
		{"current attempt in flight", stepRow{status: saga.StepDispatched, attempt: 2}, r(2), VerdictApplied},
		{"older attempt", stepRow{status: saga.StepDispatched, attempt: 2}, r(1), VerdictStale},
		{"older attempt after success", stepRow{status: saga.StepSucceeded, attempt: 3}, r(1), VerdictStale},
		{"attempt never dispatched", stepRow{status: saga.StepDispatched, attempt: 1}, r(2), VerdictStale},
		{"already succeeded", stepRow{status: saga.StepSucceeded, attempt: 1}, r(1), VerdictDuplicate},
		{"already failed", stepRow{status: saga.StepFailed, attempt: 1}, r(1), VerdictDuplicate},
		{"retry already scheduled", stepRow{status: saga.StepRetrying, attempt: 1}, r(1), VerdictDuplicate},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, judge(tc.row, tc.reply))
		})
	}
}
