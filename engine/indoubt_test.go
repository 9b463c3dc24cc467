package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// standbyThatNeverAnswers starts a server of the test's own whose
// synchronous standby never answers, with database name, and a pool of
// maxConns on it. The engine's own commits do not wait for the standby;
// a step's that sets synchronous_commit = on does, until it is cut.
func standbyThatNeverAnswers(t *testing.T, name string, maxConns int32) (*testenv.PGServer, *pgxpool.Pool) {
	t.Helper()
	srv := testenv.StartPGPrimary(t)
	url := srv.CreateDB(name)
	srv.Exec("alter system set synchronous_standby_names = 'nobody'")
	srv.Exec("select pg_reload_conf()")
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "local"
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return srv, pool
}

// TestCommitWhoseAnswerIsLost: a step's COMMIT (the start's too: the
// first step commits with it) waits for a synchronous
// standby that never answers, and its connection is cut there, as a
// primary that crashes after its commit reached the standby would cut it:
// PostgreSQL keeps the commit, the step worker sees its connection break.
// The worker asks the database whether its outcome committed, finds it
// did, and runs the next step, whose command only it held, at once: the
// saga finishes although its leases are an hour long, with the next step
// dispatched once and nothing sent again, and the step that lost its
// answer ran once.
func TestCommitWhoseAnswerIsLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv, pool := standbyThatNeverAnswers(t, "indoubt", 6)
	_, err := pool.Exec(ctx, `create table effects (step text primary key)`)
	require.NoError(t, err)

	var runs atomic.Int32
	effect := func(ctx context.Context, sc *saga.StepContext) error {
		_, err := sc.Tx.Exec(ctx, `insert into effects (step) values ($1)`, sc.Step)
		return err
	}
	def := saga.MustNew("indoubt",
		saga.Step{Name: "one", Reaches: "oned", Kind: saga.DatabaseStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				runs.Add(1)
				if _, err := sc.Tx.Exec(ctx, `set local synchronous_commit = on`); err != nil {
					return nil, err
				}
				return nil, effect(ctx, sc)
			}},
		saga.Step{Name: "two", Reaches: "twoed", Kind: saga.DatabaseStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				return nil, effect(ctx, sc)
			}},
	)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("INDOUBT")
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.LeaseGrace = time.Hour })

	// The first step commits with the start (Start returns after both),
	// so the start's answer is in doubt too.
	started := make(chan engine.StartResult, 1)
	go func() {
		res, err := e.Client().Start(ctx, def, "in-doubt-1", map[string]int{"n": 1})
		require.NoError(t, err)
		started <- res
	}()
	// Cut the step's connection while its COMMIT waits for the standby.
	admin, err := pgx.Connect(ctx, srv.URL("postgres"))
	require.NoError(t, err)
	defer admin.Close(ctx)
	require.Eventually(t, func() bool {
		var cut bool
		err := admin.QueryRow(ctx, `select coalesce(bool_or(pg_terminate_backend(pid)), false) from pg_stat_activity
where datname = 'indoubt' and wait_event = 'SyncRep'`).Scan(&cut)
		return err == nil && cut
	}, 30*time.Second, 5*time.Millisecond, "the step's COMMIT waits for the standby")
	res := <-started
	require.False(t, res.Duplicate, "the start whose answer was lost finds its own saga")

	var state string
	require.Eventually(t, func() bool {
		err := pool.QueryRow(ctx, `select state from idemsaga.sagas where id = $1 and finished_at is not null`, pguuid.Of(res.ID)).Scan(&state)
		return err == nil
	}, 30*time.Second, 10*time.Millisecond, "the saga finishes without waiting for a lease of an hour")
	require.Equal(t, "twoed", state)
	var steps, resent, beyond int
	require.NoError(t, pool.QueryRow(ctx, `select count(*), count(resent_attempt), count(*) filter (where attempt > 1) from idemsaga.steps where saga_id = $1`,
		pguuid.Of(res.ID)).Scan(&steps, &resent, &beyond))
	require.Equal(t, []int{2, 0, 0}, []int{steps, resent, beyond}, "two steps, none sent again, none past attempt 1")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects`).Scan(&effects))
	require.Equal(t, 2, effects)
	require.Equal(t, int32(1), runs.Load(), "the step whose answer was lost ran once")
}

// TestCommitCutByItsDeadline: a step run at once (its claim sent with the
// move before it) sends its COMMIT, which waits for a synchronous
// standby past the attempt's deadline. The client gives up: it closes
// the connection and sends a cancel, which ends the wait with the
// transaction committed. The server commits after the client saw its
// error; the worker must not read the answer before then, or it takes
// the step for not committed, and the next step, whose command only it
// held, waits for its lease (an hour here). Several sagas are cut at
// once, holding every connection of the pool until they know: the
// question goes on a connection of its own.
func TestCommitCutByItsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const sagas = 4
	_, pool := standbyThatNeverAnswers(t, "cutcommit", sagas)
	_, err := pool.Exec(ctx, `create table effects (saga uuid, step text, primary key (saga, step))`)
	require.NoError(t, err)

	var slowRuns atomic.Int32
	effect := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		_, err := sc.Tx.Exec(ctx, `insert into effects (saga, step) values ($1, $2)`, sc.SagaID, sc.Step)
		return nil, err
	}
	def := saga.MustNew("cutcommit",
		saga.Step{Name: "one", Reaches: "oned", Kind: saga.DatabaseStep, Forward: effect},
		saga.Step{Name: "two", Reaches: "twoed", Kind: saga.DatabaseStep,
			Retry: saga.RetryPolicy{Timeout: time.Second, MaxAttempts: 5},
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				slowRuns.Add(1)
				if _, err := sc.Tx.Exec(ctx, `set local synchronous_commit = on`); err != nil {
					return nil, err
				}
				return effect(ctx, sc)
			}},
		saga.Step{Name: "three", Reaches: "threed", Kind: saga.DatabaseStep, Forward: effect},
	)
	_, nc := testenv.NATS(t)
	e := startEngine(t, pool, nc, testenv.Name("CUTCOMMIT"), []*saga.Definition{def}, func(c *engine.Config) { c.LeaseGrace = time.Hour })

	ids := make(chan uuid.UUID, sagas)
	var wg sync.WaitGroup
	for i := range sagas {
		wg.Go(func() {
			res, err := e.Client().Start(ctx, def, fmt.Sprintf("cut-%d", i), map[string]int{"n": i})
			assert.NoError(t, err)
			ids <- res.ID
		})
	}
	wg.Wait()
	close(ids)
	for id := range ids {
		var state string
		require.Eventually(t, func() bool {
			err := pool.QueryRow(ctx, `select state from idemsaga.sagas where id = $1 and finished_at is not null`, pguuid.Of(id)).Scan(&state)
			return err == nil
		}, 30*time.Second, 10*time.Millisecond, "saga %s finishes without waiting for a lease of an hour", id)
		require.Equal(t, "threed", state)
	}
	var steps, resent, beyond int
	require.NoError(t, pool.QueryRow(ctx, `select count(*), count(resent_attempt), count(*) filter (where attempt > 1) from idemsaga.steps`).Scan(&steps, &resent, &beyond))
	require.Equal(t, []int{3 * sagas, 0, 0}, []int{steps, resent, beyond}, "three steps a saga, none sent again, none past attempt 1")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects`).Scan(&effects))
	require.Equal(t, 3*sagas, effects)
	require.Equal(t, int32(sagas), slowRuns.Load(), "each step whose commit outlived its client ran once")
}
