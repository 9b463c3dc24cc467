package engine_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// clusterKnob reads an integer or duration knob of the cluster failover
// test from the environment (larger runs by hand), or gives def.
func clusterKnob[T int | time.Duration](t *testing.T, name string, def T) T {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	var out T
	switch p := any(&out).(type) {
	case *int:
		n, err := strconv.Atoi(v)
		require.NoError(t, err, name)
		*p = n
	case *time.Duration:
		d, err := time.ParseDuration(v)
		require.NoError(t, err, name)
		*p = d
	}
	return out
}

// clusterLayout places the leaders of the engine's consumers relative to
// the stream's leader on a 3-node cluster, and names the node that dies
// and how: each node is an offset from the stream leader's (0 is that
// node).
type clusterLayout struct {
	steps, replies, kill int
	// crash cuts the node off before it stops (testenv's Crash): it
	// hands no leadership over, and the others elect new leaders only
	// when they stop hearing from it. Otherwise it shuts down, stepping
	// its leaders down first.
	crash bool
}

// TestClusterStreamLeaderFailover runs transfers on a 3-node JetStream
// cluster with a 3-replica stream, shuts the stream's leader down mid-run
// and brings it back on its store. Every saga ends, nothing is applied
// twice or lost (reconcile and the transfer audit), the work queue is
// empty at the end, and no lease runs out: what the lost leader held is
// driven again promptly, not when leases expire (the engine's record, not
// the wall clock, says so). The node killed leads the stream and both
// consumers, so pull requests, deliveries awaiting acks and the stream's
// writes are all lost with it.
//
// IDEMSAGA_CLUSTER_SAGAS (300) and IDEMSAGA_CLUSTER_LEASE_GRACE (10s, on
// top of a 10s step timeout) size a larger run by hand.
func TestClusterStreamLeaderFailover(t *testing.T) {
	t.Parallel()
	clusterFailover(t, clusterLayout{})
}

// TestClusterSpreadLeadersFailover is the common case: the consumers'
// leaders are on the two nodes that do not lead the stream, and the
// stream's leader shuts down, or crashes. The consumers keep their
// leaders, and with them the pull requests the workers on the lost node
// made before their connections moved; what is delivered meanwhile, and
// what the relay published during the election, is still driven within
// seconds.
func TestClusterSpreadLeadersFailover(t *testing.T) {
	t.Parallel()
	for _, crash := range []bool{false, true} {
		name := "shutdown"
		if crash {
			name = "crash"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			clusterFailover(t, clusterLayout{steps: 1, replies: 2, crash: crash})
		})
	}
}

// TestClusterConsumerLeaderFailover: the node that leads the commands'
// consumer crashes while the stream's leader, and the replies' consumer's,
// live on.
func TestClusterConsumerLeaderFailover(t *testing.T) {
	t.Parallel()
	clusterFailover(t, clusterLayout{steps: 1, replies: 2, kill: 1, crash: true})
}

// clusterFailover runs the failover of layout; see
// TestClusterStreamLeaderFailover.
func clusterFailover(t *testing.T, layout clusterLayout) {
	ctx := context.Background()
	n := clusterKnob(t, "IDEMSAGA_CLUSTER_SAGAS", 300)
	grace := clusterKnob(t, "IDEMSAGA_CLUSTER_LEASE_GRACE", 10*time.Second)
	policy := fastPolicy // a 10s step timeout
	lease := policy.Timeout + grace
	cluster := testenv.NATSCluster(t, 3)
	pool := testenv.DB(t)
	def, err := fixture.Transfer(policy)
	require.NoError(t, err)
	seeded := seedForLoad(t, pool)
	stream := testenv.Name("CLUSTER")
	defs := []*saga.Definition{def}
	var engines []*engine.Engine
	var regs []*prometheus.Registry
	for range 3 {
		reg := prometheus.NewRegistry()
		regs = append(regs, reg)
		engines = append(engines, startEngine(t, pool, cluster.Connect(t), stream, defs, func(c *engine.Config) {
			c.Registerer = reg
			c.StreamReplicas = 3
			c.LeaseGrace = grace
			// Few slots of their own: most commands cross the broker.
			c.StepConcurrency = 2
			if os.Getenv("IDEMSAGA_CLUSTER_LOG") != "" {
				c.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			}
		}))
	}
	info, err := mustJS(t, cluster.Connect(t)).Stream(ctx, stream)
	require.NoError(t, err)
	require.Equal(t, 3, info.CachedInfo().Config.Replicas)

	// Starts are spread over a few seconds, from clients without step
	// workers so that first commands cross the broker.
	starters := []*engine.Client{brokerClient(t, pool, stream, def), brokerClient(t, pool, stream, def)}
	var credited, compensated int
	inputs := make([]fixture.Input, n)
	rng := rand.New(rand.NewPCG(7, uint64(n)))
	for i := range inputs {
		from := 1 + rng.Int64N(50)
		to := 1 + (from+rng.Int64N(49))%50
		if i%10 == 3 {
			to, compensated = 51, compensated+1
		} else {
			credited++
		}
		inputs[i] = transferInput(from, to, 1+rng.Int64N(20))
	}
	spread := 6 * time.Second
	startErrs := make(chan error, n)
	var submitted sync.WaitGroup
	submitted.Go(func() {
		var wg sync.WaitGroup
		sem := make(chan struct{}, 16)
		tick := time.NewTicker(spread / time.Duration(n))
		defer tick.Stop()
		for i := range n {
			<-tick.C
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				_, err := starters[i%len(starters)].Start(ctx, def, key(i), inputs[i])
				startErrs <- err
			})
		}
		wg.Wait()
		close(startErrs)
	})

	finished := func() int {
		var c int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is not null`).Scan(&c))
		return c
	}
	require.Eventually(t, func() bool { return finished() >= n/3 }, time.Minute, 10*time.Millisecond, "a third of the sagas finish before the kill")
	leader := cluster.WaitStreamLeader(stream, 10*time.Second)
	admin := cluster.Connect(t)
	steps, replies := (leader+layout.steps)%3, (leader+layout.replies)%3
	cluster.GatherConsumer(admin, stream, stream+"_steps_transfer", steps, 10*time.Second)
	cluster.GatherConsumer(admin, stream, stream+"_orchestrator_transfer", replies, 10*time.Second)
	require.Equal(t, leader, cluster.StreamLeader(stream), "moving the consumers' leaders keeps the stream's")
	killed := (leader + layout.kill) % 3
	var killedAt time.Time
	require.NoError(t, pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&killedAt))
	if layout.crash {
		cluster.Crash(killed)
	} else {
		cluster.Kill(killed)
	}
	before := finished()
	newLeader := cluster.WaitStreamLeader(stream, 30*time.Second)
	if killed == leader {
		require.NotEqual(t, leader, newLeader)
	}
	// Sagas go on with two nodes of three.
	require.Eventually(t, func() bool { return finished() > before || finished() == n }, lease, 10*time.Millisecond, "sagas finish while a node is down")
	time.Sleep(time.Second)
	cluster.Restart(killed)

	submitted.Wait()
	for err := range startErrs {
		require.NoError(t, err)
	}
	waitAllFinished(t, pool, 2*lease+time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	diffs, err := engine.Reconcile(ctx, pool, defs, time.Second)
	require.NoError(t, err)
	require.Empty(t, diffs)

	// The time lost: the longest saga against the median, the sagas that
	// took longer than 5 s, and the longest gap between two completions
	// after the kill.
	var longestS, medianS, gapS float64
	var slow int
	require.NoError(t, pool.QueryRow(ctx, `select
  extract(epoch from max(finished_at - created_at))::float8,
  percentile_cont(0.5) within group (order by extract(epoch from finished_at - created_at)),
  count(*) filter (where finished_at - created_at > interval '5 seconds')
  from idemsaga.sagas`).Scan(&longestS, &medianS, &slow))
	require.NoError(t, pool.QueryRow(ctx, `select coalesce(extract(epoch from max(d))::float8, 0) from (
  select finished_at - lag(finished_at) over (order by finished_at) d from idemsaga.sagas where finished_at >= $1) x`, killedAt).Scan(&gapS))
	seconds := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	longest, median, gap := seconds(longestS), seconds(medianS), seconds(gapS)
	var takeovers, overTimeout int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where attempt > 1`).Scan(&takeovers))
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at - created_at > $1::interval`, policy.Timeout.String()).Scan(&overTimeout))
	// What the lost leader held was driven again promptly, not when its
	// lease ran out: the engine records a lease it acted on as an attempt
	// taken over or a command found lost and sent again (in its tables),
	// or as a command kept at its attempt, still queued or running (in its
	// counters).
	runOut, err := testenv.LeasesRunOut(ctx, pool)
	require.NoError(t, err)
	var requeued, takenOver float64
	for _, reg := range regs {
		requeued += metricSum(t, reg, "idemsaga_commands_requeued_total", nil)
		takenOver += metricSum(t, reg, "idemsaga_lease_takeovers_total", nil)
	}
	require.NotEmpty(t, engines)
	t.Logf("cluster failover: %d sagas, lease %s; stream led by %s, steps' consumer by %s, replies' by %s; %s %s after %d finished; %d leases ran out (%v requeued, %v taken over); longest saga %s (median %s), %d over 5s, %d over the step timeout (%s), longest gap in completions after the kill %s, %d steps past attempt 1",
		n, lease, cluster.Name(leader), cluster.Name(steps), cluster.Name(replies), cluster.Name(killed), map[bool]string{false: "shut down", true: "crashed"}[layout.crash], before,
		len(runOut), requeued, takenOver, longest.Round(time.Millisecond), median.Round(time.Millisecond), slow, overTimeout, policy.Timeout, gap.Round(time.Millisecond), takeovers)
	require.Empty(t, runOut, "leases that ran out: something the lost leader held waited for its lease")
	require.Zero(t, requeued+takenOver, "commands kept or taken over when their lease ran out (%v requeued, %v taken over)", requeued, takenOver)

	// Every command and reply was acked or removed: nothing stays in the
	// work queue.
	js := mustJS(t, admin)
	if !assert.Eventually(t, func() bool {
		s, err := js.Stream(ctx, stream)
		return err == nil && s.CachedInfo().State.Msgs == 0
	}, 30*time.Second, 50*time.Millisecond, "the work-queue stream is empty") {
		logQueue(t, js, stream)
		t.FailNow()
	}
}

func mustJS(t *testing.T, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

// logQueue logs what stays in the work queue and what its consumers say.
func logQueue(t *testing.T, js jetstream.JetStream, stream string) {
	ctx := context.Background()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Logf("stream: %v", err)
		return
	}
	st := s.CachedInfo().State
	t.Logf("stream %s: %d messages, seq %d..%d", stream, st.Msgs, st.FirstSeq, st.LastSeq)
	for _, c := range []string{"_steps_transfer", "_orchestrator_transfer"} {
		ci, err := s.Consumer(ctx, stream+c)
		if err != nil {
			t.Logf("consumer %s: %v", c, err)
			continue
		}
		i := ci.CachedInfo()
		t.Logf("consumer %s: delivered %+v, ack floor %+v, pending %d, ack pending %d, redelivered %d, waiting %d, leader %s",
			c, i.Delivered, i.AckFloor, i.NumPending, i.NumAckPending, i.NumRedelivered, i.NumWaiting, i.Cluster.Leader)
	}
	for seq, shown := st.FirstSeq, 0; seq <= st.LastSeq && shown < 20; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		shown++
		t.Logf("left: seq %d %s id %s at %s", seq, m.Subject, m.Header.Get("Nats-Msg-Id"), m.Time.Format("15:04:05.000"))
	}
}

// TestStartWaitsForAFormingCluster: an engine started while its 3-node
// cluster has one node up (no JetStream leader, every API call unanswered)
// keeps asking for its stream and consumers, and starts once the other
// nodes come back, instead of exiting.
func TestStartWaitsForAFormingCluster(t *testing.T) {
	t.Parallel()
	cluster := testenv.NATSCluster(t, 3)
	cluster.Kill(1)
	cluster.Kill(2)
	pool := testenv.DB(t)
	def, err := fixture.Transfer(fastPolicy)
	require.NoError(t, err)
	var logs syncLog
	cfg := engine.Config{Pool: pool, NATS: testenv.Connect(t, cluster.URLs()), Definitions: []*saga.Definition{def},
		Stream: testenv.Name("FORMING"), StreamReplicas: 3, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	cfg.SubjectPrefix = "t." + cfg.Stream
	require.NoError(t, engine.Deploy(context.Background(), cfg))
	e, err := engine.New(cfg)
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- e.Start(context.Background()) }()
	// Back once the engine has been refused an answer at least once.
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(logs.String(), "JetStream is not ready") {
		select {
		case err := <-started:
			t.Fatalf("the engine's start ended before the cluster had a leader: %v\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "the engine asked nothing in 60 s:\n%s", logs.String())
	}
	cluster.Restart(1, 2)
	require.NoError(t, <-started, logs.String())
	t.Cleanup(func() { _ = e.Stop(context.Background()) })
}

// syncLog is a log buffer safe for an engine's goroutines and a test.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncLog) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncLog) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
