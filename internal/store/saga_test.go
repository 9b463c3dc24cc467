package store_test

import (
	"context"
	"strings"
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

// TestLookupByKeyUsesTheIndex: a lookup by key alone, and a list filtered
// by key, read the sagas of that key through the (definition, idem_key)
// index, not every saga.
func TestLookupByKeyUsesTheIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	for _, q := range []struct {
		name, sql string
		args      []any
	}{
		{"SelectSagasByKey", store.SelectSagasByKey, []any{"k"}},
		{"ListSagasByKey", store.ListSagasByKey, listArgs("k")},
		{"ListSagasByKeyOldestFirst", store.ListSagasByKeyOldestFirst, listArgs("k")},
	} {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "set local enable_seqscan = off")
		require.NoError(t, err)
		rows, err := tx.Query(ctx, "explain "+q.sql, q.args...)
		require.NoError(t, err)
		var plan []string
		for rows.Next() {
			var line string
			require.NoError(t, rows.Scan(&line))
			plan = append(plan, line)
		}
		require.NoError(t, rows.Err())
		require.NoError(t, tx.Rollback(ctx))
		// The index is probed by definition and key, not read whole
		// and filtered by key.
		require.Regexp(t, `Index Cond: \(\(definition = ANY .*\) AND \(idem_key = `, strings.Join(plan, "\n"), "%s:\n%s", q.name, strings.Join(plan, "\n"))
	}
}

// listArgs are ListSagas's parameters for a key and no other filter.
func listArgs(key string) []any {
	return []any{"", "", 0.0, false, 0.0, 10, nil, nil, false, 0, key, nil, nil, false, false}
}
