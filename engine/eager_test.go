package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"

	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestDispatchedStepsRunInTheProcess: a saga started by an engine's own
// client runs its first step in that engine's process when a slot is free
// (else through the broker), and a database step's transaction that
// dispatches the next step leaves its command off the broker: the same
// process runs it at once, its claim sent with the COMMIT, on the
// connection the first step held. With two connections for eight slots,
// every saga ends, no step but a first one crosses the broker, and no
// transaction is left open.
func TestDispatchedStepsRunInTheProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	seeded := seedForLoad(t, shared)
	cfg := shared.Config().Copy()
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("EAGER")

	var mu sync.Mutex
	published := map[string]bool{}
	sub, err := nc.Subscribe("t."+stream+".cmd.>", func(m *nats.Msg) {
		mu.Lock()
		published[m.Header.Get(nats.MsgIdHdr)] = true
		mu.Unlock()
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	def := transferDef(t)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.StepConcurrency = 8 })
	const n = 100
	credited, compensated := submitTransfers(t, def, n, e.Client())
	waitAllFinished(t, pool, time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)

	firsts := map[string]bool{}
	rows, err := shared.Query(ctx, `select id from idemsaga.sagas`)
	require.NoError(t, err)
	for rows.Next() {
		var id uuid.UUID
		require.NoError(t, rows.Scan(&id))
		firsts["c-"+saga.MessageID(saga.StepKey(id, fixture.StepDeduct, saga.PhaseForward), 1)] = true
	}
	require.NoError(t, rows.Err())
	require.Len(t, firsts, n)
	mu.Lock()
	for id := range published {
		require.True(t, firsts[id], "only first steps cross the broker; %s did", id)
	}
	t.Logf("%d of %d first steps crossed the broker", len(published), n)
	mu.Unlock()
	var steps, open int
	require.NoError(t, shared.QueryRow(ctx, `select
  (select count(*) from idemsaga.steps where phase = 'forward' and status in ('succeeded', 'failed')),
  (select count(*) from pg_stat_activity where datname = current_database() and state like 'idle in transaction%')`).Scan(&steps, &open))
	require.Equal(t, 2*n, steps, "both forward steps of every saga ran")
	require.Zero(t, open, "no claim left open")

	// One saga at a time, every slot free: none crosses the broker.
	mu.Lock()
	before := len(published)
	mu.Unlock()
	for i := range 10 {
		res, err := e.Client().Start(ctx, def, fmt.Sprintf("alone-%d", i), transferInput(1, 2, 1))
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		sg, err := e.Client().Wait(wctx, res.ID)
		cancel()
		require.NoError(t, err)
		require.Equal(t, fixture.StateCredited, sg.State)
	}
	mu.Lock()
	require.Equal(t, before, len(published), "each ran in the process that started it")
	mu.Unlock()
	var left int
	require.NoError(t, shared.QueryRow(ctx, `select count(*) from idemsaga.outbox`).Scan(&left))
	require.Zero(t, left, "each first command's row was deleted with its step's outcome")
}

// TestClaimWithTheCommitFindsTheKeyHeld: the claim of a dispatched step,
// sent with the COMMIT of the step before, meets its key already held by a
// success (another attempt's, committed first). The step's handler does
// not run; the stored success moves the saga on at once, not a lease later.
func TestClaimWithTheCommitFindsTheKeyHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("HELD")
	def := transferDef(t)

	// Started by a client whose engine runs nothing: the first command
	// waits in the outbox for the relay of the engine started below.
	starter := idleEngine(t, pool, nc, stream, prometheus.NewRegistry(), def)
	res, err := starter.Client().Start(ctx, def, "held", transferInput(1, 2, 30))
	require.NoError(t, err)
	credit := def.Step(1).Name
	creditKey := saga.StepKey(res.ID, credit, saga.PhaseForward)
	_, err = pool.Exec(ctx, `insert into idemsaga.inbox (saga_id, step_key, step, phase, attempt, outcome, result)
values ($1, $2, $3, 'forward', 2, 'succeeded', '{"by": "another attempt"}')`, pguuid.Of(res.ID), pguuid.Of(creditKey), credit)
	require.NoError(t, err)

	// A lease far longer than the wait: the step must not need the reaper.
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.LeaseGrace = time.Hour })
	waitAllFinished(t, pool, 15*time.Second)

	var state, result string
	var ledger int
	require.NoError(t, pool.QueryRow(ctx, `select s.state, s.results->>$2,
  (select count(*) from fixture.ledger l where l.saga_id = s.id)
from idemsaga.sagas s where s.id = $1`, res.ID, credit).Scan(&state, &result, &ledger))
	require.Equal(t, string(fixture.StateCredited), state)
	require.JSONEq(t, `{"by": "another attempt"}`, result, "the stored success is the step's result")
	require.Equal(t, 1, ledger, "the deduct ran; the credit's handler did not run again")
}

// TestSlowStepRunWhereCommittedIsNotSweptMeanwhile: a command run in the
// process that committed it keeps its outbox row locked from its claim to
// its outcome, so the relay's sweep does not publish it while the step
// runs past the hand-off: the step runs once, and nothing crosses the
// broker.
func TestSlowStepRunWhereCommittedIsNotSweptMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	slow := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if _, err := sc.Tx.Exec(ctx, `select pg_sleep(1.5)`); err != nil {
			return nil, err
		}
		return recorder("slow", nil)(ctx, sc)
	}
	def := saga.MustNew("slow",
		saga.Step{Kind: saga.DatabaseStep, Name: "slow", Reaches: "slow_done", Forward: slow},
		saga.Step{Kind: saga.DatabaseStep, Name: "after", Reaches: "after_done", Forward: recorder("after", nil)},
	)
	stream := testenv.Name("SLOW")
	var published atomic.Int64
	sub, err := nc.Subscribe("t."+stream+".cmd.>", func(*nats.Msg) { published.Add(1) })
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
		c.Registerer = reg
		c.RelayHandOff = 300 * time.Millisecond // far shorter than the step
		c.RelayPollInterval = 10 * time.Millisecond
		c.ReconcileInterval = engine.NoReconcile
	})
	res, err := e.Client().Start(ctx, def, "slow", map[string]int{})
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	sg, err := e.Client().Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("after_done"), sg.State)

	var effects int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects where saga_id = $1`, res.ID).Scan(&effects))
	require.Equal(t, 2, effects, "each step took effect once")
	require.NoError(t, nc.Flush())
	require.Zero(t, published.Load(), "the relay did not publish the command of the step in hand")
	require.Zero(t, stepDuplicates(t, reg), "no second delivery to absorb")
}
