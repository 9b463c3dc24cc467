package main

import (
	"context"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

// TestPgbenchCeilingIsOneTransactionPerRun: the ceiling's TPS counts
// transactions shaped like a step's (an UPDATE and an INSERT together),
// so that sagas/s x commits per saga / TPS compares commits with commits.
// Each run of the script commits once, not once per statement.
func TestPgbenchCeilingIsOneTransactionPerRun(t *testing.T) {
	if _, err := exec.LookPath("pgbench"); err != nil {
		t.Fatal("pgbench is required; Debian and Ubuntu ship it in the server package (apt-get install postgresql), which scripts/ensure-postgres.sh installs")
	}
	t.Parallel()
	ctx := context.Background()
	pool, dsn := testenv.DBWithURL(t)
	db := pool.Config().ConnConfig.Database
	commits := func() float64 {
		var n int64
		_, err := pool.Exec(ctx, `select pg_stat_clear_snapshot()`)
		require.NoError(t, err)
		require.NoError(t, pool.QueryRow(ctx, `select xact_commit from pg_stat_database where datname = $1`, db).Scan(&n))
		return float64(n)
	}
	before := commits()
	const seconds = 2
	tps, err := pgbenchCeiling(ctx, pool, dsn, 2, seconds)
	require.NoError(t, err)
	require.Positive(t, tps)
	// pgbench's backends report their counts as they exit; the setup's
	// few statements and the estimate of runs from TPS leave some slack.
	perRun := (commits() - before) / (tps * seconds)
	require.InDelta(t, 1.0, perRun, 0.3, "commits per pgbench run (%.0f TPS)", tps)
}
