package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestSagaMovesOfRepairsAreFenced: a repair's move of a saga writes only at
// the version its writer read under the lock, and says when it did not.
func TestSagaMovesOfRepairsAreFenced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, testenv.DB(t))

	require.ErrorIs(t, store.ReopenSaga(ctx, f.pool, f.id, f.version+1, "a_done", false), store.ErrInvariant)
	require.ErrorIs(t, store.CloseSaga(ctx, f.pool, f.id, f.version+1), store.ErrInvariant)
	_, err := store.CancelSaga(ctx, f.pool, f.id, f.version+1, saga.StateCompensating, "cancelled", false)
	require.ErrorIs(t, err, store.ErrInvariant)
	st, v, _ := f.state(t)
	require.Equal(t, []any{"init", f.version}, []any{st, v}, "a miss changes nothing")

	require.NoError(t, store.ReopenSaga(ctx, f.pool, f.id, f.version, "a_done", true))
	st, v, _ = f.state(t)
	require.Equal(t, []any{"a_done", f.version + 1}, []any{st, v})
	require.NoError(t, store.CloseSaga(ctx, f.pool, f.id, f.version+1))
	st, _, _ = f.state(t)
	require.Equal(t, "closed", st)
}

// TestPauseAndResumeSaga: a pause holds once, a resume lets go once.
func TestPauseAndResumeSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, testenv.DB(t))
	for i, want := range []bool{true, false} {
		paused, err := store.PauseSaga(ctx, f.pool, f.id)
		require.NoError(t, err)
		require.Equal(t, want, paused, "pause %d", i)
	}
	for i, want := range []bool{true, false} {
		resumed, err := store.ResumeSaga(ctx, f.pool, f.id)
		require.NoError(t, err)
		require.Equal(t, want, resumed, "resume %d", i)
	}
}
