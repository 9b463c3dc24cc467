package main_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// pgPair is a primary and a streaming replica of the test's own, with a
// migrated database, and worker processes and a client that reach it
// through one multi-host DATABASE_URL whose target_session_attrs picks
// whichever server accepts writes.
type pgPair struct {
	t                *testing.T
	primary, standby *testenv.PGServer
	url              string
	pool             *pgxpool.Pool
	client           *engine.Client
	def              *saga.Definition
	env              []string
	seeded           int64
	nc               *nats.Conn
	stream, prefix   string
}

const (
	failoverAccounts = 10 // account 10 is frozen: transfers to it are compensated
	failoverDB       = "idemsaga"
	// failoverLeaseGrace makes a lease (1s step timeout + grace) far
	// longer than the outage.
	failoverLeaseGrace = 10 * time.Second
)

func newPGPair(t *testing.T, synchronous bool, leaseGrace time.Duration) *pgPair {
	primary := testenv.StartPGPrimary(t)
	standby := primary.StartStandby("standby1")
	if synchronous {
		primary.SetSynchronous("standby1")
	}
	primary.CreateDB(failoverDB)
	url := fmt.Sprintf("postgres://postgres@%s,%s/%s?sslmode=disable&target_session_attrs=read-write", primary.Addr(), standby.Addr(), failoverDB)
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 8
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	seeded, err := transfer.Seed(context.Background(), pool, failoverAccounts, 1_000_000, failoverAccounts)
	require.NoError(t, err)

	srv, nc := testenv.NATS(t)
	stream := testenv.Name("PGFAIL")
	prefix := "pgfail." + stream
	policy := saga.RetryPolicy{Timeout: time.Second, MaxAttempts: 20, MaxBackoff: 200 * time.Millisecond}
	def, err := transfer.NewDefinition(policy)
	require.NoError(t, err)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, SubjectPrefix: prefix, Stream: stream, LeaseGrace: leaseGrace})
	require.NoError(t, err)
	return &pgPair{t: t, primary: primary, standby: standby, url: url, pool: pool, client: cl, def: def, seeded: seeded, nc: nc, stream: stream, prefix: prefix, env: []string{
		"DATABASE_URL=" + url, "NATS_URL=" + srv.ClientURL(),
		"IDEMSAGA_STREAM=" + stream, "IDEMSAGA_SUBJECT_PREFIX=" + prefix,
		"IDEMSAGA_STEP_TIMEOUT=1s", "IDEMSAGA_MAX_ATTEMPTS=20", "IDEMSAGA_MAX_BACKOFF=200ms", "IDEMSAGA_LEASE_GRACE=" + leaseGrace.String(), "HTTP_ADDR=127.0.0.1:0",
	}}
}

func (p *pgPair) startWorker(failpoints ...string) *proc {
	cmd := exec.Command(workerBin, "run", "--ack-wait", "3s", "--max-conns", "6", "--log-level", "info")
	cmd.Env = append(append(os.Environ(), p.env...), failpoint.EnvVar+"="+strings.Join(failpoints, ";"))
	w := &proc{cmd: cmd, stderr: &lockedBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = w.stderr
	require.NoError(p.t, cmd.Start())
	go func() { w.done <- cmd.Wait() }()
	p.t.Cleanup(func() { _ = cmd.Process.Kill() })
	return w
}

// transferInput is the i-th transfer of a run: every fifth to the frozen
// account, so that it is compensated.
func failoverInput(i int) (transfer.Input, bool) {
	from := int64(1 + i%(failoverAccounts-1))
	to := 1 + from%(failoverAccounts-1)
	frozen := i%5 == 4
	if frozen {
		to = failoverAccounts
	}
	return transfer.Input{From: from, To: to, Amount: int64(1 + i%50)}, frozen
}

// submitter starts n transfers from several goroutines at a steady pace,
// each retried under its key until the engine acknowledges it (a client's
// retry after an error whose outcome it cannot know).
type submitter struct {
	mu        sync.Mutex
	acked     map[string]uuid.UUID // key → saga acknowledged
	errors    atomic.Int64
	slowest   time.Duration // longest Start, retries included
	submitted atomic.Int64
}

func (p *pgPair) submit(ctx context.Context, n, workers int, every time.Duration) (*submitter, func()) {
	s := &submitter{acked: map[string]uuid.UUID{}}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			for i := w; i < n; i += workers {
				<-tick.C
				key := fmt.Sprintf("pf-%04d", i)
				in, _ := failoverInput(i)
				began := time.Now()
				for {
					res, err := p.client.Start(ctx, p.def, key, in)
					if err == nil {
						s.mu.Lock()
						s.acked[key] = res.ID
						s.slowest = max(s.slowest, time.Since(began))
						s.mu.Unlock()
						s.submitted.Add(1)
						break
					}
					s.errors.Add(1)
					if ctx.Err() != nil {
						return
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		})
	}
	return s, wg.Wait
}

// finished counts the sagas that finished, on whichever server is primary.
func (p *pgPair) finished(ctx context.Context) (int, error) {
	var n int
	err := p.pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is not null`).Scan(&n)
	return n, err
}

func (p *pgPair) waitFor(what string, timeout time.Duration, cond func(context.Context) (bool, error), workers ...*proc) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	var lastErr error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		ok, err := cond(ctx)
		cancel()
		if ok {
			return
		}
		lastErr = err
		time.Sleep(20 * time.Millisecond)
	}
	var logs string
	for _, w := range workers {
		logs += w.stderr.String()
	}
	p.t.Fatalf("%s: not after %s (last error: %v); worker logs:\n%s", what, timeout, lastErr, logs)
}

// TestPostgresFailover runs transfers through two worker processes against
// a primary with a synchronous streaming replica, crashes the primary
// (immediate stop) mid-run and promotes the replica. The workers, the
// client's pool and the relay move to the new primary through the
// multi-host DATABASE_URL; every saga the client was told had started is
// there and ends as its input says, each transfer applied once, money
// conserved, the engine's invariants holding, nothing left unpublished.
// It reports the time lost.
func TestPostgresFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newPGPair(t, true, failoverLeaseGrace)
	w1, w2 := p.startWorker(), p.startWorker()

	const n = 600
	runCtx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	sub, wait := p.submit(runCtx, n, 4, 25*time.Millisecond)
	p.waitFor("a quarter of the sagas finished", 60*time.Second, func(ctx context.Context) (bool, error) {
		f, err := p.finished(ctx)
		return f >= n/4, err
	}, w1, w2)

	stopped := time.Now()
	p.primary.Stop("immediate")
	// The time a failover manager would take to decide; the client and the
	// workers meanwhile find no server that accepts writes.
	time.Sleep(time.Second)
	p.standby.Promote()
	promoted := time.Now()
	var back time.Time
	p.waitFor("a saga finished on the new primary", 30*time.Second, func(ctx context.Context) (bool, error) {
		var ok bool
		err := p.pool.QueryRow(ctx, `select exists (select from idemsaga.sagas where finished_at >= $1)`, promoted).Scan(&ok)
		if ok {
			back = time.Now()
		}
		return ok, err
	}, w1, w2)

	wait()
	require.NoError(t, runCtx.Err(), "every start acknowledged before the deadline")
	require.Len(t, sub.acked, n)
	p.waitFor("every saga finished", 60*time.Second, func(ctx context.Context) (bool, error) {
		var running int
		err := p.pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running)
		return err == nil && running == 0, err
	}, w1, w2)
	p.waitFor("the outbox emptied by the relays", 30*time.Second, func(ctx context.Context) (bool, error) {
		var left int
		err := p.pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&left)
		return err == nil && left == 0, err
	}, w1, w2)

	// Every acknowledged start survived the failover, under the ID the
	// client was given, and ended as its input says.
	rows, err := p.pool.Query(ctx, `select idem_key, id, state from idemsaga.sagas`)
	require.NoError(t, err)
	got := map[string]uuid.UUID{}
	for rows.Next() {
		var (
			key   string
			id    uuid.UUID
			state string
		)
		require.NoError(t, rows.Scan(&key, &id, &state))
		got[key] = id
		var i int
		_, err := fmt.Sscanf(key, "pf-%d", &i)
		require.NoError(t, err)
		_, frozen := failoverInput(i)
		want := "credited"
		if frozen {
			want = "compensated"
		}
		require.Equal(t, want, state, "saga %s (%s)", key, id)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, sub.acked, got, "every acknowledged saga, and only those, under the ID acknowledged")

	rep, err := transfer.Audit(ctx, p.pool, p.seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	diffs, err := engine.Reconcile(ctx, p.pool, []*saga.Definition{p.def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)

	// No saga waited for a lease: the workers sent what they had in hand
	// again at once, and a commit whose answer the crash took was found
	// committed. The engine records a lease that ran out as an attempt
	// taken over, or as a command found lost and sent again.
	runOut, err := testenv.LeasesRunOut(ctx, p.pool)
	require.NoError(t, err)
	if len(runOut) > 0 {
		// When each lost command was dispatched, beside the outage, and
		// what the workers said, for whoever reads the failure.
		rows, err := p.pool.Query(ctx, `select saga_id::text || ' ' || step || ' attempt ' || attempt || ' dispatched ' ||
  round(extract(epoch from dispatched_at - $1::timestamptz)::numeric, 3)::text || 's after the crash'
  from idemsaga.steps where resent_attempt is not null`, stopped)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		t.Fatalf("leases that ran out: %v\nthe replica was promoted %s after the crash, and the first saga finished there %s after the crash; a lease ran %s; found lost: %v\nworker logs:\n%s\n%s",
			runOut, promoted.Sub(stopped).Round(time.Millisecond), back.Sub(stopped).Round(time.Millisecond), time.Second+failoverLeaseGrace, lines, w1.stderr.String(), w2.stderr.String())
	}
	var longest, median float64
	require.NoError(t, p.pool.QueryRow(ctx, `select extract(epoch from max(finished_at - created_at)),
  extract(epoch from percentile_cont(0.5) within group (order by finished_at - created_at)) from idemsaga.sagas`).Scan(&longest, &median))
	w1.stop(t)
	w2.stop(t)
	t.Logf("failover: %d sagas, 0 differences; primary down to replica promoted %s (1s of it the simulated decision); promoted to the first saga finished there %s; longest saga %.2fs, median %.3fs; %d start errors retried by the client, longest start %s",
		n, promoted.Sub(stopped).Round(time.Millisecond), back.Sub(promoted).Round(time.Millisecond), longest, median, sub.errors.Load(), sub.slowest.Round(time.Millisecond))
}

// startBatch starts the transfers numbered from lo to hi (excluded) through
// cl and returns the saga each key was acknowledged with.
func (p *pgPair) startBatch(cl *engine.Client, lo, hi int) map[string]uuid.UUID {
	p.t.Helper()
	ids := map[string]uuid.UUID{}
	for i := lo; i < hi; i++ {
		key := fmt.Sprintf("pf-%04d", i)
		in, _ := failoverInput(i)
		res, err := cl.Start(context.Background(), p.def, key, in)
		require.NoError(p.t, err)
		ids[key] = res.ID
	}
	return ids
}

// sagaIDs reads the saga of each key there is.
func (p *pgPair) sagaIDs() map[string]uuid.UUID {
	p.t.Helper()
	rows, err := p.pool.Query(context.Background(), `select idem_key, id from idemsaga.sagas`)
	require.NoError(p.t, err)
	ids, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		key string
		id  uuid.UUID
	}, error) {
		var v struct {
			key string
			id  uuid.UUID
		}
		return v, r.Scan(&v.key, &v.id)
	})
	require.NoError(p.t, err)
	m := map[string]uuid.UUID{}
	for _, v := range ids {
		m[v.key] = v.id
	}
	return m
}

func (p *pgPair) waitAllFinished(timeout time.Duration, workers ...*proc) {
	p.t.Helper()
	p.waitFor("every saga finished", timeout, func(ctx context.Context) (bool, error) {
		var running int
		err := p.pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running)
		return err == nil && running == 0, err
	}, workers...)
}

func (p *pgPair) audit() {
	p.t.Helper()
	ctx := context.Background()
	rep, err := transfer.Audit(ctx, p.pool, p.seeded)
	require.NoError(p.t, err)
	require.Empty(p.t, rep.Differences)
	diffs, err := engine.Reconcile(ctx, p.pool, []*saga.Definition{p.def}, time.Minute)
	require.NoError(p.t, err)
	require.Empty(p.t, diffs)
}

// TestPostgresAsyncFailoverLosesAcknowledgedCommits shows what
// asynchronous replication risks and what the engine then does. The
// replica stops receiving WAL (as a lagging one would at the moment of
// the crash), the primary acknowledges more work, crashes, and the
// replica is promoted:
//   - sagas started and finished after the lag began are lost whole
//     (saga, steps, inbox, ledger): the database is consistent, 0
//     differences, but the client was told they had started. Its retry
//     under the same key creates each again, with a new saga ID (so new
//     step keys), and it runs once on the new primary;
//   - a command already in the broker for such a saga finds no saga and
//     is dropped with a warning;
//   - sagas whose start had reached the replica but whose steps had not
//     come back at the same step keys (their leases expire; the relay
//     sends their commands again) and finish, each effect applied once on
//     what survived.
func TestPostgresAsyncFailoverLosesAcknowledgedCommits(t *testing.T) {
	t.Parallel()
	p := newPGPair(t, false, time.Second)

	// A: finished and replicated.
	w := p.startWorker()
	kept := p.startBatch(p.client, 0, 10)
	p.waitAllFinished(30*time.Second, w)
	w.stop(t)
	// D: started with no worker running, replicated: saga rows, first
	// steps and outbox rows on both servers.
	resumed := p.startBatch(p.client, 10, 20)
	p.standby.WaitCaughtUp(p.primary)
	p.standby.StopStreaming()

	// From here nothing reaches the replica. D runs to its end, B starts
	// and finishes, all acknowledged by the primary alone.
	w = p.startWorker()
	lostFinished := p.startBatch(p.client, 20, 30)
	p.waitAllFinished(30*time.Second, w)
	w.stop(t)
	// C: started with no worker running; then a worker's relay publishes
	// their first commands and dies before it marks them: they wait in the
	// stream.
	lostInFlight := p.startBatch(p.client, 30, 40)
	relay := p.startWorker(failpoint.RelayBeforeMark + "=exit*1")
	require.Equal(t, failpoint.ExitCode, relay.wait(t, 30*time.Second), relay.stderr.String())
	inStream := p.pending()
	require.Positive(t, inStream, "commands of C in the stream")

	p.primary.Stop("immediate")
	p.standby.Promote()
	// The test's pool holds connections to the crashed server: drop them
	// rather than retry each query once.
	p.pool.Reset()

	got := p.sagaIDs()
	for k, id := range kept {
		require.Equal(t, id, got[k], "saga %s was replicated", k)
	}
	for k, id := range resumed {
		require.Equal(t, id, got[k], "saga %s's start was replicated", k)
	}
	for k := range lostFinished {
		require.NotContains(t, got, k, "saga %s finished on the old primary alone", k)
	}
	for k := range lostInFlight {
		require.NotContains(t, got, k, "saga %s started on the old primary alone", k)
	}
	var unfinished int
	require.NoError(t, p.pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&unfinished))
	require.Equal(t, len(resumed), unfinished, "the replicated starts whose steps were lost run again")
	// What survived is consistent: the lost sagas' ledger rows went with
	// them, and money is conserved (the resumed sagas are not finished).
	rep, err := transfer.Audit(context.Background(), p.pool, p.seeded)
	require.NoError(t, err)
	for _, d := range rep.Differences {
		require.Contains(t, d, "is not finished")
	}

	w = p.startWorker()
	p.waitAllFinished(30*time.Second, w)
	p.waitFor("the commands of the lost sagas dropped", 30*time.Second, func(context.Context) (bool, error) {
		return strings.Count(w.stderr.String(), "command for a saga that no longer exists; dropped") >= inStream, nil
	}, w)
	var rerun int
	require.NoError(t, p.pool.QueryRow(context.Background(), `select count(*) from idemsaga.steps where attempt > 1`).Scan(&rerun))

	// The client retries what it had been told started: each is created
	// again under a new ID, and runs once.
	again := p.startBatch(p.client, 20, 40)
	for k, id := range again {
		if old, ok := lostFinished[k]; ok {
			require.NotEqual(t, old, id, "saga %s created again", k)
		} else {
			require.NotEqual(t, lostInFlight[k], id, "saga %s created again", k)
		}
	}
	p.waitAllFinished(30*time.Second, w)
	w.stop(t)
	p.audit()
	require.Len(t, p.sagaIDs(), 40)
	t.Logf("asynchronous failover: %d acknowledged sagas lost (%d finished, %d started, %d commands of theirs in the broker, dropped), recreated by the client's retries; %d replicated starts finished on the new primary, %d of their steps at attempt 2 or later; 0 differences",
		len(lostFinished)+len(lostInFlight), len(lostFinished), len(lostInFlight), inStream, len(resumed), rerun)
}

// pending counts the messages in the stream (a work queue: those not
// acknowledged yet).
func (p *pgPair) pending() int {
	p.t.Helper()
	js, err := jetstream.New(p.nc)
	require.NoError(p.t, err)
	st, err := js.Stream(context.Background(), p.stream)
	require.NoError(p.t, err)
	info, err := st.Info(context.Background())
	require.NoError(p.t, err)
	return int(info.State.Msgs)
}
