package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// submitTransfers starts n transfers through starters (round robin), from
// accounts 1..50 to accounts 1..50, except every tenth which goes to a
// frozen account (51) and must be compensated. Every tenth transfer is also
// submitted a second time with the same key. It returns the expected
// number of credited and compensated sagas.
func submitTransfers(t *testing.T, def *saga.Definition, n int, starters ...*engine.Client) (credited, compensated int) {
	t.Helper()
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	inputs := make([]fixture.Input, n)
	for i := range inputs {
		from := 1 + rng.Int64N(50)
		to := 1 + (from+rng.Int64N(49))%50
		if i%10 == 3 {
			to = 51
			compensated++
		} else {
			credited++
		}
		inputs[i] = transferInput(from, to, 1+rng.Int64N(20))
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	sem := make(chan struct{}, 16)
	for i := range n {
		times := 1
		if i%10 == 7 {
			times = 2
		}
		for j := range times {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				cl := starters[(i+j)%len(starters)]
				_, err := cl.Start(ctx, def, key(i), inputs[i])
				errs <- err
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	return credited, compensated
}

func seedForLoad(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	total, err := fixture.Seed(context.Background(), pool, 51, 1_000_000, 51)
	require.NoError(t, err)
	return total
}

func requireAudit(t *testing.T, pool *pgxpool.Pool, seeded int64, credited, compensated int) {
	t.Helper()
	rep, err := fixture.Audit(context.Background(), pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"credited": credited, "compensated": compensated}, rep.ByState)
	// Rows the broker acknowledged are deleted in batches, and rows whose
	// publish after commit failed wait for the sweep: the outbox drains
	// within the relay's hand-off.
	require.Eventually(t, func() bool {
		var unpublished int
		require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.outbox where published_at is null`).Scan(&unpublished))
		return unpublished == 0
	}, 20*time.Second, 20*time.Millisecond, "outbox drained")
}

func TestFiveHundredTransfersConserveMoney(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, testenv.Name("LOAD"), []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg })

	credited, compensated := submitTransfers(t, def, 500, e.Client())
	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	require.Equal(t, 500.0, metricSum(t, reg, "idemsaga_sagas_started_total", nil))
	require.Equal(t, 50.0, metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "start"}))
	// A finish is counted once its commit returned, which can follow the
	// read that saw the saga finished.
	waitMetric(t, reg, "idemsaga_sagas_finished_total", map[string]string{"outcome": "completed"}, float64(credited))
	waitMetric(t, reg, "idemsaga_sagas_finished_total", map[string]string{"outcome": "compensated"}, float64(compensated))
}

// TestEveryCommandPublishedThreeTimes republishes every command twice more
// under fresh message ids, so the broker's dedup cannot help: the inbox
// must absorb them.
func TestEveryCommandPublishedThreeTimes(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	reg := prometheus.NewRegistry()
	stream := testenv.Name("TRIPLE")
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg })

	js, err := jetstream.New(nc)
	require.NoError(t, err)
	var copies sync.WaitGroup
	var copied atomic.Int64
	sub, err := nc.Subscribe("t."+stream+".cmd.>", func(m *nats.Msg) {
		if m.Header.Get("X-Test-Copy") != "" {
			return
		}
		copied.Add(2)
		copies.Go(func() {
			for i := 1; i <= 2; i++ {
				c := nats.NewMsg(m.Subject)
				c.Data = m.Data
				c.Header.Set("X-Test-Copy", fmt.Sprint(i))
				_, err := js.PublishMsg(context.Background(), c, jetstream.WithMsgID(fmt.Sprintf("copy%d-%s", i, m.Header.Get(nats.MsgIdHdr))))
				if err != nil {
					t.Errorf("publish copy: %v", err)
				}
			}
		})
	})
	require.NoError(t, err)
	defer sub.Unsubscribe() //nolint:errcheck

	// Started from a client without step workers, so that every first
	// command crosses the broker, where it is copied.
	const n = 100
	credited, compensated := submitTransfers(t, def, n, brokerClient(t, pool, stream, def))
	waitAllFinished(t, pool, 2*time.Minute)
	require.NoError(t, sub.Unsubscribe())
	copies.Wait()
	// Let the copies still in the stream be consumed before auditing.
	require.Eventually(t, func() bool {
		info, err := js.Stream(context.Background(), stream)
		if err != nil {
			return false
		}
		st, err := info.Info(context.Background())
		return err == nil && st.State.Msgs == 0
	}, time.Minute, 20*time.Millisecond, "stream drained")

	requireAudit(t, pool, seeded, credited, compensated)
	// Every command published is copied twice: the first steps' (the
	// engine runs a step its own transaction dispatched at once, without
	// the broker), and any other a worker published. A copy is absorbed by
	// the step worker that remembers answering its attempt, or else by the
	// inbox.
	waitStepsRan(t, reg, float64(2*n+compensated))
	commands := metricSum(t, reg, "idemsaga_step_attempts_total", nil)
	dups := stepDuplicates(t, reg)
	require.GreaterOrEqual(t, copied.Load(), int64(2*n), "the first step of every saga went through the broker")
	require.Equal(t, float64(copied.Load()), dups, "every copy absorbed")
	require.Equal(t, float64(2*n+compensated), commands-dups, "each step ran once: a deduct and a credit per saga, a refund per compensated one")
}

func TestTwoWorkerPoolsShareTheWork(t *testing.T) {
	t.Parallel()
	pool, url := testenv.DBWithURL(t)
	srv, nc1 := testenv.NATS(t)
	nc2 := testenv.Connect(t, srv.ClientURL())
	pool2, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool2.Close)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	stream := testenv.Name("TWO")
	reg1, reg2 := prometheus.NewRegistry(), prometheus.NewRegistry()
	e1 := startEngine(t, pool, nc1, stream, []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg1 })
	e2 := startEngine(t, pool2, nc2, stream, []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg2 })

	credited, compensated := submitTransfers(t, def, 500, e1.Client(), e2.Client())
	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	for _, reg := range []*prometheus.Registry{reg1, reg2} {
		require.Positive(t, metricSum(t, reg, "idemsaga_step_attempts_total", nil), "both pools ran steps")
	}
}

// TestReplyTwiceAndStaleReply applies replies by hand: a duplicate and a
// reply of an older attempt change nothing.
func TestReplyTwiceAndStaleReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, LeaseGrace: time.Hour})
	require.NoError(t, err) // not started: we play the orchestrator's consumer
	res, err := e.Client().Start(ctx, def, "k", transferInput(1, 2, 10))
	require.NoError(t, err)

	type snap struct {
		state   saga.State
		version int64
		outbox  int
		steps   string
	}
	snapshot := func() snap {
		var s snap
		require.NoError(t, pool.QueryRow(ctx, `select state, version, (select count(*) from idemsaga.outbox),
  (select string_agg(step || '/' || phase || '/' || status || '/' || attempt, ',' order by step, phase) from idemsaga.steps)
  from idemsaga.sagas where id = $1`, res.ID).Scan(&s.state, &s.version, &s.outbox, &s.steps))
		return s
	}
	reply := func(step string, attempt int, outcome wire.Outcome, result string) wire.Reply {
		return wire.Reply{SagaID: res.ID, Definition: def.Name(), Step: step, Phase: saga.PhaseForward,
			Key: saga.StepKey(res.ID, step, saga.PhaseForward), Attempt: attempt, Outcome: outcome, Result: json.RawMessage(result)}
	}

	deducted := reply(fixture.StepDeduct, 1, wire.OutcomeSucceeded, `{"account":1,"amount":-10}`)
	v, err := e.ApplyReply(ctx, deducted)
	require.NoError(t, err)
	require.Equal(t, engine.VerdictApplied, v)
	after := snapshot()
	require.Equal(t, fixture.StateDeducted, after.state)

	v, err = e.ApplyReply(ctx, deducted)
	require.NoError(t, err)
	require.Equal(t, engine.VerdictDuplicate, v)
	require.Equal(t, after, snapshot(), "a reply delivered twice changes nothing")

	// The credit's first attempt, claimed by a worker, loses its lease:
	// attempt 2 goes out.
	_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second', claimed_attempt = attempt where step = 'credit'`)
	require.NoError(t, err)
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, moved)
	retried := snapshot()
	require.Contains(t, retried.steps, "credit/forward/dispatched/2")

	// Attempt 1 answers late, with a failure and then a success: stale.
	for _, late := range []wire.Reply{
		reply(fixture.StepCredit, 1, wire.OutcomeFailed, ``),
		reply(fixture.StepCredit, 1, wire.OutcomeSucceeded, `{"account":2,"amount":10}`),
	} {
		v, err = e.ApplyReply(ctx, late)
		require.NoError(t, err)
		require.Equal(t, engine.VerdictStale, v)
		require.Equal(t, retried, snapshot(), "a stale reply changes nothing")
	}

	v, err = e.ApplyReply(ctx, reply(fixture.StepCredit, 2, wire.OutcomeSucceeded, `{"account":2,"amount":10}`))
	require.NoError(t, err)
	require.Equal(t, engine.VerdictApplied, v)
	final := snapshot()
	require.Equal(t, fixture.StateCredited, final.state)
	v, err = e.ApplyReply(ctx, reply(fixture.StepCredit, 1, wire.OutcomeFailed, ``))
	require.NoError(t, err)
	require.Equal(t, engine.VerdictStale, v)
	require.Equal(t, final, snapshot())
}

// TestLostCommandIsSentAgainAtItsAttempt loses a command on the way to the
// broker: no worker claims it within its lease, the stream does not hold
// it, and the step goes out again with the same key at the same attempt,
// which the lost command never started.
func TestLostCommandIsSentAgainAtItsAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	// A lease of 2.2 s: short for the lost command to wait, long enough
	// that no attempt runs past it on a busy machine.
	policy := fastPolicy
	policy.Timeout = 2 * time.Second
	def, err := fixture.Transfer(policy)
	require.NoError(t, err)
	seeded, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)

	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, LeaseGrace: 200 * time.Millisecond})
	require.NoError(t, err)
	res, err := cl.Start(ctx, def, "lost", transferInput(1, 2, 40))
	require.NoError(t, err)
	// The broker lost it: marked published, never delivered.
	_, err = pool.Exec(ctx, `update idemsaga.outbox set published_at = now()`)
	require.NoError(t, err)

	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, testenv.Name("LEASE"), []*saga.Definition{def}, func(c *engine.Config) {
		c.LeaseGrace = 200 * time.Millisecond
		c.Registerer = reg
	})
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sg, err := e.Client().Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, fixture.StateCredited, sg.State)
	var deduct saga.StepExecution
	for _, s := range sg.Steps {
		if s.Step == fixture.StepDeduct {
			deduct = s
		}
	}
	require.Equal(t, 1, deduct.Attempt, "sent again at the attempt it never started")
	require.Equal(t, saga.StepKey(res.ID, fixture.StepDeduct, saga.PhaseForward), deduct.Key, "same key")
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"step": "deduct", "how": "resent"}))
	require.Zero(t, metricSum(t, reg, "idemsaga_lease_takeovers_total", map[string]string{"step": "deduct"}), "an attempt never claimed is not taken over")
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}

// TestOneConnectionCarriesTheLoad runs transfers, compensations and
// duplicate starts through an engine whose pool holds one connection,
// shared by its clients, step workers, reply handlers, relay and reaper.
// The engine recommends pools sized to the database rather than to its
// handlers: no path may hold a connection while it waits for another, or
// such a pool would wait on itself.
func TestOneConnectionCarriesTheLoad(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	cfg := pool.Config().Copy()
	cfg.MaxConns, cfg.MinConns = 1, 0
	one, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(one.Close)
	e := startEngine(t, one, nc, testenv.Name("ONE"), []*saga.Definition{def}, func(c *engine.Config) {
		c.StepConcurrency, c.ReplyConcurrency = 8, 4
	})

	credited, compensated := submitTransfers(t, def, 120, e.Client())
	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
}
