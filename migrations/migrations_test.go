package migrations_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/migrations"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestMigrateConcurrentlyIsIdempotent runs Migrate from several connections
// at once on a database that already has the schema dropped: one applies,
// the others find nothing to do.
func TestMigrateConcurrentlyIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `drop schema idemsaga cascade`)
	require.NoError(t, err)
	var conns []*pgx.Conn
	for range 4 {
		c, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		conns = append(conns, c)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(conns))
	for i, c := range conns {
		wg.Go(func() { errs[i] = migrations.Migrate(ctx, c) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	latest, err := migrations.Latest()
	require.NoError(t, err)
	got, err := migrations.Current(ctx, conns[0])
	require.NoError(t, err)
	require.Equal(t, latest, got)
	var tables int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from pg_tables where schemaname = 'idemsaga'`).Scan(&tables))
	require.Equal(t, 20, tables, "sagas, steps, step_attempts, outbox, inbox, settings, definitions, workers, repairs, callbacks, submit_tokens, schema_version, paused_definitions, definition_repairs, dead_letters, limit_holds, limit_rates, schedules, schedule_repairs, event_dead_letters")
}

func TestCurrentOnEmptyDatabaseIsZero(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := pool.Exec(ctx, `drop schema idemsaga cascade`)
	require.NoError(t, err)
	c, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c.Release()
	v, err := migrations.Current(ctx, c.Conn())
	require.NoError(t, err)
	require.Zero(t, v)
}
