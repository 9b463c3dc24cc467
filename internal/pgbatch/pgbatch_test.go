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

// TestRunKeepsStatementsUnlessTheyMayBeStale: a batch that fails on a
// raise (idemsaga.expect's, or a handler's), a constraint violation or a
// lock timeout leaves its
// statements prepared on the connection; one that fails with an error a
// stale statement can give leaves pgx to drop them, as it does. Callbacks
// run in order up to the failure.
func TestRunKeepsStatementsUnlessTheyMayBeStale(t *testing.T) {
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
		// failWith raises code for any argument but 0.
		failWith = `select case when $1::int = 0 then 0 else pg_temp.fail_with($2::text) end`
	)
	_, err = conn.Exec(ctx, `create function pg_temp.fail_with(code text) returns int language plpgsql as $$
begin
    raise exception using errcode = code, message = 'failed on purpose';
end
$$`)
	require.NoError(t, err)
	prepared := func(sql string) bool {
		var n int
		require.NoError(t, conn.QueryRow(ctx, `select count(*) from pg_prepared_statements where statement = $1`, sql).Scan(&n))
		return n == 1
	}
	for _, tc := range []struct {
		name    string
		last    string
		ok, bad []any // the last statement's arguments that pass, and fail
		code    string
		raised  bool
		kept    bool
	}{
		{"a raise of ours", raise, []any{0}, []any{1}, "IDM01", true, true},
		{"a data error", fail, []any{1}, []any{0}, "22012", false, false},
		{"a unique violation", failWith, []any{0, "23505"}, []any{1, "23505"}, "23505", false, true},
		{"a handler's raise", failWith, []any{0, "TR001"}, []any{1, "TR001"}, "TR001", false, true},
		{"a lock timeout", failWith, []any{0, "55P03"}, []any{1, "55P03"}, "55P03", false, true},
		{"a stale plan", failWith, []any{0, "0A000"}, []any{1, "0A000"}, "0A000", false, false},
		{"an undefined table", failWith, []any{0, "42P01"}, []any{1, "42P01"}, "42P01", false, false},
		{"an internal error", failWith, []any{0, "XX000"}, []any{1, "XX000"}, "XX000", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got int
			b := &pgx.Batch{}
			b.Queue(plain, 1).QueryRow(func(row pgx.Row) error { return row.Scan(&got) })
			b.Queue(tc.last, tc.ok...)
			require.NoError(t, pgbatch.Run(ctx, conn, b))
			require.Equal(t, 2, got)

			b = &pgx.Batch{}
			b.Queue(plain, 2).QueryRow(func(row pgx.Row) error { return row.Scan(&got) })
			b.Queue(tc.last, tc.bad...)
			err := pgbatch.Run(ctx, conn, b)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, tc.code, pgErr.Code)
			require.Equal(t, tc.raised, pgbatch.Raised(err))
			require.Equal(t, 3, got, "the callbacks before the failure ran")
			require.Equal(t, tc.kept, prepared(plain), "statements kept unless the error can come from a stale statement")
			require.Equal(t, tc.kept, prepared(tc.last))
		})
	}
}

// TestRunRecoversFromAStaleStatement: a statement prepared before its
// column's type changed fails with a data error (it still sends the old
// parameter type), and Run lets pgx drop it, so its next use prepares it
// again and succeeds.
func TestRunRecoversFromAStaleStatement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `create table stale (a int)`)
	require.NoError(t, err)

	const insert = `insert into stale (a) values ($1)`
	run := func(arg any) error {
		b := &pgx.Batch{}
		b.Queue(insert, arg)
		return pgbatch.Run(ctx, conn, b)
	}
	require.NoError(t, run(1))
	_, err = pool.Exec(ctx, `alter table stale alter column a type text`) // from another connection
	require.NoError(t, err)
	err = run("x")
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "the statement still takes an integer")
	require.Equal(t, "22P02", pgErr.Code)
	require.NoError(t, run("x"), "prepared again, for the column's new type")
	var n int
	require.NoError(t, conn.QueryRow(ctx, `select count(*) from stale where a = 'x'`).Scan(&n))
	require.Equal(t, 1, n)
}

// TestRunAnErrorAtTheSync: a batch that is an implicit transaction commits
// at its Sync. A failure there (a deferred unique constraint) comes after
// every statement ran: Run returns it wrapping ErrAtSync, nothing of the
// batch commits, and its statements stay prepared (the failure is not a
// stale statement's).
func TestRunAnErrorAtTheSync(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `create table once (k int, constraint once_k unique (k) deferrable initially deferred);
insert into once values (1)`)
	require.NoError(t, err)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()

	const insert = `insert into once (k) values ($1)`
	b := &pgx.Batch{}
	b.Queue(insert, 2)
	b.Queue(insert, 1) // runs; the constraint is checked at the commit
	err = pgbatch.Run(ctx, conn, b)
	require.ErrorIs(t, err, pgbatch.ErrAtSync)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23505", pgErr.Code)
	require.Equal(t, byte('I'), conn.Conn().PgConn().TxStatus(), "no transaction left open")

	var rows, prepared int
	require.NoError(t, conn.QueryRow(ctx, `select count(*) from once`).Scan(&rows))
	require.Equal(t, 1, rows, "nothing of the batch committed")
	require.NoError(t, conn.QueryRow(ctx, `select count(*) from pg_prepared_statements where statement = $1`, insert).Scan(&prepared))
	require.Equal(t, 1, prepared, "the statement stays prepared")

	// A statement's own error is not at the Sync.
	b = &pgx.Batch{}
	b.Queue(`select 1 / $1::int`, 0)
	err = pgbatch.Run(ctx, conn, b)
	require.Error(t, err)
	require.NotErrorIs(t, err, pgbatch.ErrAtSync)
}
