package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// captured is one message seen on the wire.
type captured struct {
	subject string
	data    []byte
	header  nats.Header
}

// stateSnapshot is every row of the business tables and of the engine's
// saga, step and inbox tables, each as JSON text, in a fixed order. The
// outbox is left out: replies to replayed commands are new outbox rows.
type stateSnapshot map[string][]string

var snapshotQueries = map[string]string{
	"accounts": `select id, balance, frozen from fixture.accounts`,
	"ledger":   `select saga_id, step, account_id, amount, created_at from fixture.ledger`,
	"sagas":    `select id, state, version, results, error, finished_at from idemsaga.sagas`,
	"steps": `select saga_id, step, phase, step_index, key, status, attempt, lease_until,
  next_attempt_at, last_error, result, created_at from idemsaga.steps`,
	"inbox": `select step_key, saga_id, step, phase, attempt, outcome, result, error, created_at from idemsaga.inbox`,
}

func snapshotState(t *testing.T, pool *pgxpool.Pool) stateSnapshot {
	t.Helper()
	ctx := context.Background()
	snap := stateSnapshot{}
	for name, q := range snapshotQueries {
		rows, err := pool.Query(ctx, `select row_to_json(x)::text from (`+q+`) x order by 1`)
		require.NoError(t, err)
		texts, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err, name)
		snap[name] = texts
	}
	return snap
}

// streamMsgs returns the number of messages held by the stream.
func streamMsgs(ctx context.Context, js jetstream.JetStream, stream string) (uint64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

func unpublishedRows(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	var n int
	err := pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&n)
	return n, err
}

// waitQuiet waits until the stream holds nothing, then the outbox has
// nothing unpublished, then the stream holds nothing again: every command
// was handled, every reply it wrote was published, and every reply was
// applied (a work-queue stream keeps a message until it is acked, and
// handlers ack only after commit).
func waitQuiet(t *testing.T, pool *pgxpool.Pool, js jetstream.JetStream, stream string) {
	t.Helper()
	ctx := context.Background()
	streamEmpty := func() bool {
		n, err := streamMsgs(ctx, js, stream)
		return err == nil && n == 0
	}
	outboxEmpty := func() bool {
		n, err := unpublishedRows(ctx, pool)
		return err == nil && n == 0
	}
	require.Eventually(t, streamEmpty, time.Minute, 20*time.Millisecond, "stream drained")
	require.Eventually(t, outboxEmpty, time.Minute, 20*time.Millisecond, "outbox drained")
	require.Eventually(t, streamEmpty, time.Minute, 20*time.Millisecond, "stream drained again")
}

// TestReplayEveryMessageChangesNothing records every command and reply of
// a run, then publishes all of them again under fresh message ids, so the
// broker's dedup cannot help. The business tables and the engine's state
// must come out identical: the inbox absorbs every command, and the
// orchestrator judges every reply a duplicate or stale.
func TestReplayEveryMessageChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	srv, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	reg := prometheus.NewRegistry()
	stream := testenv.Name("REPLAY")
	prefix := "t." + stream
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
		c.Registerer = reg
		c.Retention.PublishedOutbox = time.Hour // keep published rows, to count them
	})
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	// Listen on a connection of our own, so draining it tells us we saw
	// everything the server routed to it.
	listener := testenv.Connect(t, srv.ClientURL())
	var mu sync.Mutex
	var seen []captured
	sub, err := listener.Subscribe(prefix+".>", func(m *nats.Msg) {
		c := captured{subject: m.Subject, data: append([]byte(nil), m.Data...), header: nats.Header{}}
		for k, v := range m.Header {
			c.header[k] = append([]string(nil), v...)
		}
		mu.Lock()
		seen = append(seen, c)
		mu.Unlock()
	})
	require.NoError(t, err)
	require.NoError(t, sub.SetPendingLimits(-1, -1))
	require.NoError(t, listener.Flush())

	// Started from a client without step workers, so that every first
	// command crosses the broker and is replayed.
	const n = 100
	credited, compensated := submitTransfers(t, def, n, brokerClient(t, pool, stream, def))
	waitAllFinished(t, pool, 2*time.Minute)
	waitQuiet(t, pool, js, stream)
	requireAudit(t, pool, seeded, credited, compensated)
	before := snapshotState(t, pool)
	require.Len(t, before["sagas"], n)

	// A message is routed to subscribers before JetStream acks it, so after
	// the round trip of Flush every message of the run is in our queue;
	// Drain lets the handler take all of them, then stops listening.
	require.NoError(t, listener.Flush())
	require.NoError(t, sub.Drain())
	require.Eventually(t, func() bool { return !sub.IsValid() }, 30*time.Second, 5*time.Millisecond, "subscription drained")
	mu.Lock()
	replay := seen
	seen = nil
	mu.Unlock()

	commands, replies := 0, 0
	for _, m := range replay {
		switch {
		case strings.HasPrefix(m.subject, prefix+".cmd."):
			commands++
		case strings.HasPrefix(m.subject, prefix+".reply."):
			replies++
		default:
			t.Fatalf("unexpected subject %q", m.subject)
		}
	}
	var outboxRows int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox`).Scan(&outboxRows))
	// Every outbox row was published at least once: we saw all of them.
	require.GreaterOrEqual(t, len(replay), outboxRows, "captured %d messages for %d outbox rows", len(replay), outboxRows)
	// Each saga's first command went through the broker. A database
	// step's outcome moves its saga on in the step's own transaction, and
	// the step that transaction dispatches runs at once in the same
	// process, so later commands and replies are rare on the wire.
	require.GreaterOrEqual(t, commands, n)
	t.Logf("replaying %d commands and %d replies (outbox rows: %d)", commands, replies, outboxRows)

	// The run's last attempts are counted once committed: in the figures
	// before the replay, not in its.
	waitStepsRan(t, reg, float64(2*n+compensated))
	inboxBefore := stepDuplicates(t, reg)
	orchBefore := metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "orchestrator"})
	staleBefore := metricSum(t, reg, "idemsaga_stale_replies_total", nil)
	attemptsBefore := metricSum(t, reg, "idemsaga_step_attempts_total", nil)
	brokerBefore := metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "broker"})

	for _, m := range replay {
		msg := nats.NewMsg(m.subject)
		msg.Data = m.data
		for k, v := range m.header {
			if k == nats.MsgIdHdr {
				continue
			}
			msg.Header[k] = v
		}
		id := m.header.Get(nats.MsgIdHdr)
		require.NotEmpty(t, id, "the relay sets a message id on every message")
		ack, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID("replay-"+id))
		require.NoError(t, err)
		require.False(t, ack.Duplicate, "a replayed message must reach the stream")
	}

	// Every replayed command reaches a step worker and is absorbed by the
	// inbox; its reply is written to the outbox and published again.
	require.Eventually(t, func() bool {
		return stepDuplicates(t, reg)-inboxBefore >= float64(commands)
	}, time.Minute, 20*time.Millisecond, "every replayed command absorbed by the step workers' memory or the inbox")
	waitQuiet(t, pool, js, stream)

	after := snapshotState(t, pool)
	for name := range snapshotQueries {
		require.Equal(t, before[name], after[name], "table %s changed by the replay", name)
	}
	requireAudit(t, pool, seeded, credited, compensated)

	inboxDups := stepDuplicates(t, reg) - inboxBefore
	orchDups := metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "orchestrator"}) - orchBefore
	stale := metricSum(t, reg, "idemsaga_stale_replies_total", nil) - staleBefore
	attempts := metricSum(t, reg, "idemsaga_step_attempts_total", nil) - attemptsBefore
	require.GreaterOrEqual(t, inboxDups, float64(commands), "inbox duplicates")
	require.Equal(t, inboxDups, attempts, "every handled replayed command was a duplicate: no handler ran")
	require.GreaterOrEqual(t, orchDups+stale, float64(replies), "every replayed reply judged a duplicate or stale")
	// The replies the inbox writes for replayed commands carry the
	// original replies' message ids, so within its window the broker drops
	// them: a fast path only, not asserted.
	brokerDups := metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "broker"}) - brokerBefore
	t.Logf("absorbed: %v by the inbox, %v by the orchestrator (%v stale), %v by the broker", inboxDups, orchDups, stale, brokerDups)
}

// TestPurgedStreamIsRecoveredByLeases purges the stream while a run is in
// flight, dropping commands and replies the broker had accepted. The
// leases re-drive every lost step from PostgreSQL.
func TestPurgedStreamIsRecoveredByLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	policy := fastPolicy
	policy.Timeout = time.Second
	policy.MaxAttempts = 5
	def, err := fixture.Transfer(policy)
	require.NoError(t, err)
	seeded := seedForLoad(t, pool)
	reg := prometheus.NewRegistry()
	stream := testenv.Name("PURGE")
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
		c.LeaseGrace = time.Second
		c.Registerer = reg
		// One command and one reply at a time, so that a backlog waits in
		// the stream, not yet delivered, when it is purged.
		c.StepConcurrency, c.ReplyConcurrency = 1, 1
	})
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	// Purge twice, each time only once the stream holds something, so the
	// test cannot pass by purging an empty stream.
	purged := make(chan uint64, 1)
	go func() {
		var total uint64
		defer func() { purged <- total }()
		time.Sleep(100 * time.Millisecond)
		deadline := time.Now().Add(30 * time.Second)
		for round := 0; round < 2 && time.Now().Before(deadline); {
			s, err := js.Stream(ctx, stream)
			if err != nil {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			info, err := s.Info(ctx)
			if err != nil || info.State.Msgs == 0 {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			if err := s.Purge(ctx); err != nil {
				t.Errorf("purge: %v", err)
				return
			}
			total += info.State.Msgs
			round++
			time.Sleep(300 * time.Millisecond)
		}
	}()

	// Started from a client without step workers: the first commands wait
	// in the stream, where the purges lose them.
	credited, compensated := submitTransfers(t, def, 100, brokerClient(t, pool, stream, def))
	lost := <-purged
	require.Positive(t, lost, "the purges removed messages")
	waitAllFinished(t, pool, 2*time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)

	var redriven int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where attempt > 1`).Scan(&redriven))
	takeovers := metricSum(t, reg, "idemsaga_lease_takeovers_total", nil)
	resent := metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"how": "resent"})
	t.Logf("purged about %d messages; %v commands sent again, %d steps re-dispatched, %v lease takeovers", lost, resent, redriven, takeovers)
	require.Positive(t, resent, "lost commands were re-driven from PostgreSQL at their leases")
	var failed int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where status = 'failed' and last_error like 'no reply after%'`).Scan(&failed))
	require.Zero(t, failed, "no step ran out of attempts")
}

// TestConcurrentTakeoverOfOneExpiredLease runs four reapers at the same
// moment against one expired lease: exactly one takes it over, and the
// step is dispatched again exactly once. The same holds when many leases
// expire at once.
func TestConcurrentTakeoverOfOneExpiredLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	const one, many = 20, 20
	seeded, err := fixture.Seed(ctx, pool, 2, 10*(one+many))
	require.NoError(t, err)
	stream := testenv.Name("TAKEOVER")

	// Not started: we play the reapers. A long grace keeps every lease
	// from expiring unless we expire it.
	reapers := make([]*engine.Engine, 4)
	regs := make([]*prometheus.Registry, len(reapers))
	for i := range reapers {
		regs[i] = prometheus.NewRegistry()
		e, err := engine.New(engine.Config{
			Pool: pool, NATS: nc, Definitions: []*saga.Definition{def},
			Stream: stream, SubjectPrefix: "t." + stream, LeaseGrace: time.Hour,
			Logger: quietLogger(), Registerer: regs[i],
		})
		require.NoError(t, err)
		reapers[i] = e
	}

	ids := make([]uuid.UUID, one+many)
	for i := range ids {
		res, err := reapers[0].Client().Start(ctx, def, fmt.Sprintf("takeover-%d", i), transferInput(1, 2, 10))
		require.NoError(t, err)
		ids[i] = res.ID
	}
	// A worker claimed each attempt (as a late delivery marks it), so
	// that its expiry is a takeover.
	expire := func(sagas ...uuid.UUID) {
		tag, err := pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second', claimed_attempt = attempt
where saga_id = any($1) and step = 'deduct' and phase = 'forward' and status = 'dispatched'`, sagas)
		require.NoError(t, err)
		require.EqualValues(t, len(sagas), tag.RowsAffected())
	}
	// reapAtOnce releases every reaper at the same moment and returns the
	// total number of steps they moved.
	reapAtOnce := func() int {
		gate := make(chan struct{})
		moved := make([]int, len(reapers))
		errs := make([]error, len(reapers))
		var wg sync.WaitGroup
		for i, e := range reapers {
			wg.Go(func() {
				<-gate
				moved[i], errs[i] = e.ReapOnce(ctx)
			})
		}
		close(gate)
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		total := 0
		for _, m := range moved {
			total += m
		}
		return total
	}

	total := 0
	for _, id := range ids[:one] {
		expire(id)
		n := reapAtOnce()
		require.Equal(t, 1, n, "saga %s: one expired lease, taken over once", id)
		total += n
	}
	// Many at once: a reaper skips a saga another reaper holds, and that
	// one moves it, so one pass of the four takes over each exactly once.
	expire(ids[one:]...)
	n := reapAtOnce()
	require.Equal(t, many, n, "many expired leases, each taken over once")
	total += n
	require.Equal(t, one+many, total)
	require.Zero(t, reapAtOnce(), "nothing left to take over")
	takeovers := 0.0
	for _, reg := range regs {
		takeovers += metricSum(t, reg, "idemsaga_lease_takeovers_total", nil)
	}
	require.Equal(t, float64(one+many), takeovers, "takeovers counted once each")

	for _, id := range ids {
		k := saga.StepKey(id, fixture.StepDeduct, saga.PhaseForward)
		var attempt int
		var status string
		require.NoError(t, pool.QueryRow(ctx, `select attempt, status from idemsaga.steps where key = $1`, k).Scan(&attempt, &status))
		require.Equal(t, 2, attempt, "saga %s", id)
		require.Equal(t, string(saga.StepDispatched), status, "saga %s", id)
		rows, err := pool.Query(ctx, `select msg_id from idemsaga.outbox where msg_id like $1 order by id`, "c-"+k.String()+"-%")
		require.NoError(t, err)
		msgIDs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Equal(t, []string{"c-" + saga.MessageID(k, 1), "c-" + saga.MessageID(k, 2)}, msgIDs, "saga %s: one command per attempt", id)
	}

	// Now let an engine run: both attempts' commands are delivered, the
	// inbox lets one take effect, and the reply of attempt 1 is stale.
	startEngine(t, pool, nc, stream, []*saga.Definition{def})
	waitAllFinished(t, pool, 2*time.Minute)
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"credited": one + many}, rep.ByState)
	var deducts, sagas int
	require.NoError(t, pool.QueryRow(ctx, `select count(*), count(distinct saga_id) from fixture.ledger where step = 'deduct'`).Scan(&deducts, &sagas))
	require.Equal(t, one+many, deducts, "one deduction per saga")
	require.Equal(t, one+many, sagas)

	// The timeline keeps the expired attempt; the current ones come from
	// the step rows.
	sg, err := reapers[0].Client().Get(ctx, ids[0])
	require.NoError(t, err)
	var timeline []string
	for _, a := range sg.Attempts {
		timeline = append(timeline, fmt.Sprintf("%s#%d:%s", a.Step, a.Attempt, a.Outcome))
		require.False(t, a.DispatchedAt.IsZero())
		require.NotNil(t, a.FinishedAt)
	}
	require.Equal(t, []string{"deduct#1:lease expired", "deduct#2:succeeded", "credit#1:succeeded"}, timeline)
}
