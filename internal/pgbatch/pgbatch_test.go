package pgbatch_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestRunKeepsStatementsAfterARaise: a batch that fails on a raise of
// idemsaga.expect leaves its statements prepared on the connection; one
// that fails otherwise leaves pgx to drop them, as it does. Callbacks run
// in order up to the failure.
func TestRunKeepsStatementsAfterARaise(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()

	const (
		plain = `select $1::int + 1`
		raise = `select idemsaga.expect($1::int = 0, 'thing')`
		fail  = `select 1 / $1::int`
	)
	prepared := func(sql string) bool {
		var n int
		require.NoError(t, conn.QueryRow(ctx, `select count(*) from pg_prepared_statements where statement = $1`, sql).Scan(&n))
		return n == 1
	}
	for _, tc := range []struct {
		name    string
		last    string
		ok, bad int // the last statement's argument that passes, and fails
		code    string
		raised  bool
	}{
		{"a raise of ours", raise, 0, 1, "IDM01", true},
		{"another error", fail, 1, 0, "22012", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got int
			b := &pgx.Batch{}
			b.Queue(plain, 1).QueryRow(func(row pgx.Row) error { return row.Scan(&got) })
			b.Queue(tc.last, tc.ok)
			require.NoError(t, pgbatch.Run(ctx, conn, b))
			require.Equal(t, 2, got)

			b = &pgx.Batch{}
			b.Queue(plain, 2).QueryRow(func(row pgx.Row) error { return row.Scan(&got) })
			b.Queue(tc.last, tc.bad)
			err := pgbatch.Run(ctx, conn, b)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, tc.code, pgErr.Code)
			require.Equal(t, tc.raised, pgbatch.Raised(err))
			require.Equal(t, 3, got, "the callbacks before the failure ran")
			require.Equal(t, tc.raised, prepared(plain), "statements kept after a raise only")
		})
	}
}
