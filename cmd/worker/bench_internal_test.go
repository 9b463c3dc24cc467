package main

import (
	"bytes"
	"context"
	"os/exec"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
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
	// pgbench's backends report their counts as they exit, which may be
	// after pgbench itself did: wait until none is left and the count
	// holds still. The setup's few statements and the estimate of runs
	// from TPS leave some slack.
	var after float64
	require.Eventually(t, func() bool {
		var left int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from pg_stat_activity where datname = $1 and application_name = 'pgbench'`, db).Scan(&left))
		if left > 0 {
			return false
		}
		now := commits()
		settled := now == after
		after = now
		return settled
	}, 30*time.Second, 200*time.Millisecond, "pgbench's backends exited and reported their commits")
	perRun := (after - before) / (tps * seconds)
	require.InDelta(t, 1.0, perRun, 0.3, "commits per pgbench run (%.0f TPS)", tps)
}

func TestSpreadChoosesAnEvenFraction(t *testing.T) {
	for _, fraction := range []float64{0, 0.05, 0.1, 1.0 / 3, 1} {
		chosen, longestGap, gap := 0, 0, 0
		for i := range 10_000 {
			if spread(i, fraction) {
				chosen++
				gap = 0
				continue
			}
			gap++
			longestGap = max(longestGap, gap)
		}
		require.InDelta(t, fraction*10_000, chosen, 1, "fraction %g", fraction)
		if fraction > 0 {
			// Evenly: never more than one period without a chosen saga.
			require.LessOrEqual(t, longestGap, int(1/fraction), "fraction %g", fraction)
		}
	}
	// Not in runs: of 0.05, no two consecutive sagas are chosen.
	for i := range 10_000 {
		require.False(t, spread(i, 0.05) && spread(i+1, 0.05), "sagas %d and %d", i, i+1)
	}
}

func TestDefaultBenchConnsFollowTheCPUs(t *testing.T) {
	require.Equal(t, 6, defaultBenchConns(2, 2))  // this machine: 12 in all
	require.Equal(t, 12, defaultBenchConns(2, 1)) // one pool takes them all
	require.Equal(t, 4, defaultBenchConns(1, 4))  // never fewer than 4 a pool
	require.Equal(t, 24, defaultBenchConns(8, 2))
}

// TestPrefillWritesSagasAsTheEngineLeavesThem: the prefilled sagas are
// finished transfers with their steps, inbox rows and ledger, that the
// engine's reconcile accepts, under UUIDv7 ids from a day before in the
// order they were numbered, so that every id the engine makes now sorts
// after them (the layout of indexes in a deployment that has run a while).
func TestPrefillWritesSagasAsTheEngineLeavesThem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	const n = 120
	require.NoError(t, prefill(ctx, pool, n))

	rows, err := pool.Query(ctx, `select s.id, s.state, s.finished_at is not null,
  (select count(*) from idemsaga.steps st where st.saga_id = s.id),
  (select count(*) from idemsaga.inbox i where i.saga_id = s.id),
  (select coalesce(sum(amount), 0) from transfer.ledger l where l.saga_id = s.id)
from idemsaga.sagas s order by substring(s.idem_key from 9)::int`)
	require.NoError(t, err)
	defer rows.Close()
	var ids []uuid.UUID
	for rows.Next() {
		var (
			id           uuid.UUID
			state        string
			finished     bool
			steps, inbox int
			ledger       int64
		)
		require.NoError(t, rows.Scan(&id, &state, &finished, &steps, &inbox, &ledger))
		require.Equal(t, uuid.Version(7), id.Version(), "saga %s", id)
		require.Equal(t, uuid.RFC4122, id.Variant(), "saga %s", id)
		sec, nsec := id.Time().UnixTime()
		require.WithinDuration(t, time.Now().Add(-24*time.Hour), time.Unix(sec, nsec), time.Hour, "saga %s", id)
		require.True(t, finished)
		g := len(ids) + 1
		wantState, wantSteps := "credited", 2
		if g%20 == 0 {
			wantState, wantSteps = "compensated", 3
		}
		require.Equal(t, wantState, state, "prefilled saga %d", g)
		require.Equal(t, wantSteps, steps, "steps of saga %s", id)
		require.Equal(t, wantSteps, inbox, "inbox rows of saga %s", id)
		require.Zero(t, ledger, "ledger of saga %s", id)
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	require.Len(t, ids, n)
	var attempts int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.step_attempts where outcome = 'retry'`).Scan(&attempts))
	require.Equal(t, 1, attempts, "one retried credit in a hundred sagas")
	now, err := uuid.NewV7()
	require.NoError(t, err)
	for i, id := range ids {
		if i > 0 {
			require.Negative(t, bytes.Compare(ids[i-1][:], id[:]), "prefilled ids in the order they were numbered")
		}
		require.Negative(t, bytes.Compare(id[:], now[:]), "a prefilled id sorts before the engine's new ones")
	}

	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{transfer.Definition}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}
