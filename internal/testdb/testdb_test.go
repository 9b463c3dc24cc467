package testdb_test

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testdb"
)

func adminURL() string {
	if v := os.Getenv("DATABASE_URL"); v != "" {
		return v
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

func TestMain(m *testing.M) {
	testdb.Manage()
	code := m.Run()
	testdb.Cleanup(context.Background(), adminURL())
	os.Exit(code)
}

func connect(t *testing.T, name string) *pgx.Conn {
	t.Helper()
	url, err := testdb.URL(adminURL(), name)
	require.NoError(t, err)
	conn, err := pgx.Connect(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// TestReleasedDatabaseIsTheTemplateAgain: a database whose rows a test
// changed comes back with the template's rows and sequences; one whose
// catalogue it changed is dropped, and the next test gets a new clone.
func TestReleasedDatabaseIsTheTemplateAgain(t *testing.T) {
	ctx := context.Background()
	tp, err := testdb.Get(ctx, adminURL(), "testdb_test", t.Name(), func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `create schema app;
create table app.clock (offset_ms bigint not null); insert into app.clock values (0);
create table app.items (id bigserial primary key, name text not null)`)
		return err
	})
	require.NoError(t, err)

	first, err := tp.Take(ctx)
	require.NoError(t, err)
	conn := connect(t, first)
	_, err = conn.Exec(ctx, `update app.clock set offset_ms = 5000; insert into app.items (name) values ('a'), ('b')`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	require.NoError(t, tp.Release(ctx, first))

	again, err := tp.Take(ctx)
	require.NoError(t, err)
	require.Equal(t, first, again, "a database whose rows changed is reused")
	conn = connect(t, again)
	var offset, items int64
	require.NoError(t, conn.QueryRow(ctx, `select (select offset_ms from app.clock), (select count(*) from app.items)`).Scan(&offset, &items))
	require.Zero(t, offset, "the template's row is back")
	require.Zero(t, items, "the rows the test wrote are gone")
	var id int64
	require.NoError(t, conn.QueryRow(ctx, `insert into app.items (name) values ('c') returning id`).Scan(&id))
	require.EqualValues(t, 1, id, "its sequence starts again")

	// A table the test added: the database is dropped.
	_, err = conn.Exec(ctx, `create table app.extra (x int)`)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	require.NoError(t, tp.Release(ctx, again))
	next, err := tp.Take(ctx)
	require.NoError(t, err)
	require.NotEqual(t, again, next, "a database whose catalogue changed is not reused")
	var exists bool
	admin, err := pgx.Connect(ctx, adminURL())
	require.NoError(t, err)
	defer admin.Close(ctx)
	require.NoError(t, admin.QueryRow(ctx, `select exists (select from pg_database where datname = $1)`, again).Scan(&exists))
	require.False(t, exists, "and it was dropped")
	require.NoError(t, tp.Release(ctx, next))
}
