package engine_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestQueueingSpendsNoAttempt holds back two engines' step workers (their
// consumer paused) while hundreds of first commands wait in the stream for
// many leases, with the reapers running. Released, every step completes at
// attempt 1: no lease was taken over and no command queued in the stream
// sent twice.
func TestQueueingSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	// Leases of 2.2 s: short enough to run out many times while the
	// commands are held, long enough that no attempt runs past one on a
	// busy machine once they are released.
	policy := fastPolicy
	policy.Timeout = 2 * time.Second
	policy.MaxAttempts = 2
	def, err := fixture.Transfer(policy)
	require.NoError(t, err)
	seeded := seedForLoad(t, pool)
	stream := testenv.Name("QUEUED")
	const grace = 200 * time.Millisecond
	lease := policy.Timeout + grace
	regs := []*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	for _, reg := range regs {
		startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) {
			c.LeaseGrace, c.Registerer, c.StepConcurrency = grace, reg, 4
		})
	}
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	_, err = s.PauseConsumer(ctx, stream+"_steps_"+def.Name(), time.Now().Add(time.Hour))
	require.NoError(t, err)

	const n = 300
	held := time.Now()
	credited, compensated := submitTransfers(t, def, n, brokerClient(t, pool, stream, def))
	sum := func(name string, labels map[string]string) float64 {
		total := 0.0
		for _, reg := range regs {
			total += metricSum(t, reg, name, labels)
		}
		return total
	}
	// Held for at least four leases, and until the reapers have found
	// every first command's lease run out at least once.
	require.Eventually(t, func() bool {
		return time.Since(held) > 4*lease && sum("idemsaga_commands_requeued_total", map[string]string{"how": "queued"}) >= n
	}, time.Minute, 20*time.Millisecond, "the reapers find the queued commands' leases run out")
	var waiting int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where status = 'dispatched' and lease_until > now()`).Scan(&waiting))
	t.Logf("held %s (%.0f leases); %d steps dispatched, their timers pushed", time.Since(held).Round(time.Millisecond), float64(time.Since(held))/float64(lease), waiting)

	_, err = s.ResumeConsumer(ctx, stream+"_steps_"+def.Name())
	require.NoError(t, err)
	waitAllFinished(t, pool, time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)

	var maxAttempt, ended int
	require.NoError(t, pool.QueryRow(ctx, `select max(attempt) from idemsaga.steps`).Scan(&maxAttempt))
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.step_attempts`).Scan(&ended))
	if maxAttempt != 1 {
		rows, err := pool.Query(ctx, `select st.step, st.phase::text, st.attempt, st.status::text, coalesce(st.last_error, ''), st.claimed_attempt, coalesce(a.outcome::text, ''), coalesce(a.error, '')
from idemsaga.steps st left join idemsaga.step_attempts a using (saga_id, step, phase) where st.attempt > 1 limit 10`)
		require.NoError(t, err)
		for rows.Next() {
			vals, _ := rows.Values()
			t.Logf("%v", vals)
		}
		rows.Close()
		t.Logf("takeovers %v, resent %v", sum("idemsaga_lease_takeovers_total", nil), sum("idemsaga_commands_requeued_total", map[string]string{"how": "resent"}))
	}
	require.Equal(t, 1, maxAttempt, "every step completed at attempt 1")
	require.Zero(t, ended, "no attempt ended other than by its outcome")
	var marked int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where step = 'deduct' and claimed_attempt = 1`).Scan(&marked))
	// Every first command delivered late restarted its lease at its
	// claim. A copy the reaper sent again (of a command held in a
	// worker's buffer, below) may be delivered fresh, before the original:
	// its lease was just restarted by the send, and it claims unmarked.
	resent := int(sum("idemsaga_commands_requeued_total", map[string]string{"how": "resent"}))
	require.GreaterOrEqual(t, marked, n-resent, "every first command delivered late restarted its lease at its claim (%d resent)", resent)
	require.LessOrEqual(t, marked, n)
	require.Zero(t, sum("idemsaga_lease_takeovers_total", nil), "no lease taken over")
	// A command a worker already pulled into its buffer (twice its step
	// concurrency) or handed to a handler waiting for a slot is no longer
	// queued; if its lease runs out there it is sent again once, and the
	// inbox absorbs the copy. The 300 queued in the stream are not.
	require.LessOrEqual(t, sum("idemsaga_commands_requeued_total", map[string]string{"how": "resent"}), float64(2*3*4),
		"no command queued in the stream sent twice; at most those held in the workers' buffers")
}

// TestExpiredLeaseIsTakenOverOnlyFromAClaim expires the leases of steps no
// worker claimed, and of steps whose key's lock a running attempt holds:
// the first are kept at their attempt; the second get a lease from the
// moment their claim was seen, and are taken over when that one runs out.
func TestExpiredLeaseIsTakenOverOnlyFromAClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	_, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	// Not started: the test plays the reaper.
	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def},
		Stream: testenv.Name("CLAIM"), LeaseGrace: time.Hour, Logger: quietLogger(), Registerer: reg})
	require.NoError(t, err)
	const n = 16 // lock ids of both signs
	ids := make([]uuid.UUID, n)
	for i := range ids {
		res, err := e.Client().Start(ctx, def, fmt.Sprintf("claim-%d", i), transferInput(1, 2, 1))
		require.NoError(t, err)
		ids[i] = res.ID
	}
	// Even sagas: an attempt runs, holding its key's lock shared as a
	// claim does.
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	for i := 0; i < n; i += 2 {
		k := saga.StepKey(ids[i], fixture.StepDeduct, saga.PhaseForward)
		_, err := holder.Exec(ctx, `select pg_advisory_xact_lock_shared($1, $2)`, store.LockClass, store.LockID(k))
		require.NoError(t, err)
	}
	expireAndReap := func() {
		t.Helper()
		_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second' where saga_id = any($1)`, ids)
		require.NoError(t, err)
		moved, err := e.ReapOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, n, moved)
	}
	expireAndReap()
	var marked int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where saga_id = any($1) and claimed_attempt = 1 and attempt = 1 and lease_until > now()`, ids).Scan(&marked))
	require.Equal(t, n/2, marked, "the running attempts' leases restarted from their claims")
	require.Zero(t, metricSum(t, reg, "idemsaga_lease_takeovers_total", nil), "no lease of a claim just seen is taken over")
	expireAndReap()
	for i, id := range ids {
		var attemptNo int
		require.NoError(t, pool.QueryRow(ctx, `select attempt from idemsaga.steps where saga_id = $1 and step = 'deduct'`, id).Scan(&attemptNo))
		if i%2 == 0 {
			require.Equal(t, 2, attemptNo, "saga %d: a running attempt's expired lease is taken over", i)
		} else {
			require.Equal(t, 1, attemptNo, "saga %d: an unclaimed command keeps its attempt", i)
		}
	}
	require.Equal(t, float64(n/2), metricSum(t, reg, "idemsaga_lease_takeovers_total", nil))
	require.Equal(t, float64(n/2), metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"how": "claimed"}))
	require.Equal(t, float64(n), metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"how": "resent"}), "unclaimed commands kept at their attempt, twice each")
}

// lostCommandEngine is an engine the test plays the reaper of (not
// started: its relay publishes nothing), on a stream whose consumers
// exist and hold nothing, so that every command dispatched looks lost.
func lostCommandEngine(t *testing.T) (*engine.Engine, *prometheus.Registry, *pgxpool.Pool, *saga.Definition) {
	t.Helper()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	_, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	stream := testenv.Name("LOST")
	prefix := "t." + stream
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Retention: jetstream.WorkQueuePolicy})
	require.NoError(t, err)
	for suffix, filter := range map[string]string{"_steps_" + def.Name(): prefix + ".cmd." + def.Name() + ".>", "_orchestrator_" + def.Name(): prefix + ".reply." + def.Name()} {
		_, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: stream + suffix, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy})
		require.NoError(t, err)
	}
	reg := prometheus.NewRegistry()
	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def},
		Stream: stream, SubjectPrefix: prefix, LeaseGrace: time.Hour, Logger: quietLogger(), Registerer: reg})
	require.NoError(t, err)
	return e, reg, pool, def
}

// expireAndReap runs the lease of saga id's steps out and makes one
// reaper pass.
func expireAndReap(t *testing.T, e *engine.Engine, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second' where saga_id = $1`, id)
	require.NoError(t, err)
	_, err = e.ReapOnce(ctx)
	require.NoError(t, err)
}

// TestCommandLostTwiceSpendsItsAttempt: a command found lost is sent again
// at its attempt; lost again, the attempt counts as started and its next
// expiry is a takeover. Were it sent again forever, a handler that kills
// its worker, or a command no worker runs, would never run out of
// attempts.
func TestCommandLostTwiceSpendsItsAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e, reg, pool, def := lostCommandEngine(t)
	res, err := e.Client().Start(ctx, def, "lost-twice", transferInput(1, 2, 1))
	require.NoError(t, err)
	step := func() (attemptNo int, claimed *int) {
		t.Helper()
		require.NoError(t, pool.QueryRow(ctx, `select attempt, claimed_attempt from idemsaga.steps where saga_id = $1 and step = 'deduct'`, res.ID).Scan(&attemptNo, &claimed))
		return attemptNo, claimed
	}
	expireAndReap(t, e, pool, res.ID)
	n, claimed := step()
	require.Equal(t, 1, n)
	require.Nil(t, claimed, "lost once: sent again, unclaimed")
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"how": "resent"}))

	expireAndReap(t, e, pool, res.ID)
	n, claimed = step()
	require.Equal(t, 1, n)
	require.NotNil(t, claimed, "lost twice: the attempt counts as started")
	require.Equal(t, 1, *claimed)

	expireAndReap(t, e, pool, res.ID)
	n, _ = step()
	require.Equal(t, 2, n, "the claimed attempt's expiry is a takeover")
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_lease_takeovers_total", nil))
}

// TestResumeClearsTheClaim: a step whose late delivery marked its attempt
// claimed, then paused and resumed, is sent again at that attempt with no
// claim: the copy sent before the pause never ran (its claim was refused),
// so the resent copy waiting in a queue past its lease costs no attempt.
func TestResumeClearsTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e, reg, pool, def := lostCommandEngine(t)
	res, err := e.Client().Start(ctx, def, "resume-claim", transferInput(1, 2, 1))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set claimed_attempt = attempt, resent_attempt = attempt where saga_id = $1`, res.ID)
	require.NoError(t, err)
	_, err = e.Client().Pause(ctx, res.ID, engine.Repair{Reason: "incident"})
	require.NoError(t, err)
	_, err = e.Client().Resume(ctx, res.ID, engine.Repair{Reason: "over"})
	require.NoError(t, err)
	_, err = e.ReapOnce(ctx) // the resume's resend
	require.NoError(t, err)
	var claimed, resent *int
	require.NoError(t, pool.QueryRow(ctx, `select claimed_attempt, resent_attempt from idemsaga.steps where saga_id = $1 and step = 'deduct'`, res.ID).Scan(&claimed, &resent))
	require.Nil(t, claimed)
	require.Nil(t, resent)
	expireAndReap(t, e, pool, res.ID)
	var attemptNo int
	require.NoError(t, pool.QueryRow(ctx, `select attempt from idemsaga.steps where saga_id = $1 and step = 'deduct'`, res.ID).Scan(&attemptNo))
	require.Equal(t, 1, attemptNo)
	require.Zero(t, metricSum(t, reg, "idemsaga_lease_takeovers_total", nil))
}
