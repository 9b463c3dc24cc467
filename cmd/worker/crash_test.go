package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// deployment is one isolated database, broker, stream and payment service
// for worker subprocesses.
type deployment struct {
	t      *testing.T
	pool   *pgxpool.Pool
	env    []string
	client *engine.Client
	def    *saga.Definition
	order  *saga.Definition
	seeded int64
	// orders and undone count the orders submitted, and those that end
	// compensated.
	orders, undone int
}

func newDeployment(t *testing.T) *deployment {
	pool, dbURL := testenv.DBWithURL(t)
	srv, _ := testenv.NATS(t)
	stream := testenv.Name("CRASH")
	prefix := "crash." + stream
	seeded, err := transfer.Seed(context.Background(), pool, 6, 1000, 6)
	require.NoError(t, err)
	require.NoError(t, order.Seed(context.Background(), pool, 2, 1000))
	// The order example's payment service, on loopback in this process.
	// It confirms each charge by callback through the test's client.
	svc := payments.New(pool, slog.New(slog.DiscardHandler))
	var clp atomic.Pointer[engine.Client]
	svc.SetNotifier(func(ctx context.Context, n payments.Notice) error {
		cl := clp.Load()
		if cl == nil {
			return errors.New("the test's client is not ready")
		}
		result, err := json.Marshal(n.Charge)
		if err != nil {
			return err
		}
		_, err = cl.Complete(ctx, engine.Callback{Token: n.Token, EventID: n.EventID, Result: result})
		return err
	})
	pay := httptest.NewServer(svc.Handler())
	t.Cleanup(pay.Close)
	t.Cleanup(svc.Close)
	// Short timeouts, so that leases and redeliveries happen within
	// seconds; the test's client uses the same definitions and lease grace
	// as the workers, as every client of a deployment must.
	policy := saga.RetryPolicy{Timeout: time.Second, MaxAttempts: 20, MaxBackoff: 200 * time.Millisecond}
	def, err := transfer.NewDefinition(policy)
	require.NoError(t, err)
	orderDef, err := order.NewDefinition(order.Config{PaymentsURL: pay.URL, Policy: policy})
	require.NoError(t, err)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def, orderDef}, SubjectPrefix: prefix, LeaseGrace: time.Second})
	require.NoError(t, err)
	clp.Store(cl)
	return &deployment{t: t, pool: pool, client: cl, def: def, order: orderDef, seeded: seeded, env: []string{
		"DATABASE_URL=" + dbURL, "NATS_URL=" + srv.ClientURL(),
		"IDEMSAGA_STREAM=" + stream, "IDEMSAGA_SUBJECT_PREFIX=" + prefix, "IDEMSAGA_PAYMENTS_URL=" + pay.URL,
		"IDEMSAGA_STEP_TIMEOUT=1s", "IDEMSAGA_MAX_ATTEMPTS=20", "IDEMSAGA_MAX_BACKOFF=200ms", "IDEMSAGA_LEASE_GRACE=1s", "HTTP_ADDR=127.0.0.1:0",
	}}
}

type proc struct {
	cmd    *exec.Cmd
	stderr *lockedBuffer
	done   chan error
}

// lockedBuffer is a worker's stderr, read by the test while the worker
// writes it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// startWorker runs `worker run` with short timeouts so that leases and
// redeliveries happen within seconds.
func (d *deployment) startWorker(failpoints string) *proc {
	cmd := exec.Command(workerBin, "run", "--ack-wait", "3s", "--max-conns", "6", "--log-level", "warn")
	cmd.Env = append(append(os.Environ(), d.env...), failpoint.EnvVar+"="+failpoints)
	p := &proc{cmd: cmd, stderr: &lockedBuffer{}, done: make(chan error, 1)}
	cmd.Stderr = p.stderr
	require.NoError(d.t, cmd.Start())
	go func() { p.done <- cmd.Wait() }()
	d.t.Cleanup(func() { _ = cmd.Process.Kill() })
	return p
}

func (p *proc) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case err := <-p.done:
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		}
		require.NoError(t, err, p.stderr.String())
		return 0
	case <-time.After(timeout):
		t.Fatalf("worker still running after %s; stderr:\n%s", timeout, p.stderr.String())
		return -1
	}
}

func (p *proc) stop(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	require.Equal(t, 0, p.wait(t, 45*time.Second), p.stderr.String())
}

// submit starts n transfers, every fifth to the frozen account 6, and n/2
// orders, every fifth declined and every fifth undeliverable.
func (d *deployment) submit(n int) (credited, compensated int) {
	for i := range n / 2 {
		in := order.Input{Customer: "ann", Product: 1 + int64(i%2), Quantity: 1, Amount: int64(100 + i), Address: "1 Main St"}
		switch i % 5 {
		case 1:
			in.Customer = "declined-bob"
			d.undone++
		case 3:
			in.Address = order.Undeliverable
			d.undone++
		}
		_, err := d.client.Start(context.Background(), d.order, fmt.Sprintf("o-%03d", i), in)
		require.NoError(d.t, err)
		d.orders++
	}
	for i := range n {
		to := int64(1 + (i+1)%5)
		if i%5 == 4 {
			to = 6
			compensated++
		} else {
			credited++
		}
		from := int64(1 + i%5)
		if from == to {
			to = 1 + to%5
		}
		_, err := d.client.Start(context.Background(), d.def, fmt.Sprintf("k-%03d", i), transfer.Input{From: from, To: to, Amount: int64(1 + i)})
		require.NoError(d.t, err)
	}
	return credited, compensated
}

func (d *deployment) waitFinished(timeout time.Duration, workers ...*proc) {
	d.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var running int
		require.NoError(d.t, d.pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running))
		if running == 0 {
			return
		}
		if time.Now().After(deadline) {
			var logs strings.Builder
			for _, w := range workers {
				logs.WriteString(w.stderr.String())
			}
			var steps string
			_ = d.pool.QueryRow(context.Background(), `select string_agg(step || '/' || phase || '/' || status || '/' || attempt, ', ') from (select * from idemsaga.steps limit 10) s`).Scan(&steps)
			var outbox string
			_ = d.pool.QueryRow(context.Background(), `select count(*) filter (where published_at is null) || ' unpublished of ' || count(*) from idemsaga.outbox`).Scan(&outbox)
			d.t.Fatalf("%d sagas still running after %s; steps: %s; outbox: %s; worker logs:\n%s", running, timeout, steps, outbox, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// check requires the outcome of a run without any crash: every transfer
// credited or compensated as its input says, money conserved, ledgers
// matching; every order shipped or compensated as its input says, charged
// once or refunded, stock conserved; and the engine's invariants holding.
func (d *deployment) check(credited, compensated int) {
	d.t.Helper()
	ctx := context.Background()
	rep, err := transfer.Audit(ctx, d.pool, d.seeded)
	require.NoError(d.t, err)
	require.Empty(d.t, rep.Differences)
	want := map[string]int{"credited": credited}
	if compensated > 0 {
		want["compensated"] = compensated
	}
	require.Equal(d.t, want, rep.ByState)
	ord, err := order.Audit(ctx, d.pool)
	require.NoError(d.t, err)
	require.Empty(d.t, ord.Differences)
	wantOrders := map[string]int{}
	for state, n := range map[string]int{"shipped": d.orders - d.undone, "compensated": d.undone} {
		if n > 0 {
			wantOrders[state] = n
		}
	}
	require.Equal(d.t, wantOrders, ord.ByState)
	diffs, err := engine.Reconcile(ctx, d.pool, []*saga.Definition{d.def, d.order}, time.Minute)
	require.NoError(d.t, err)
	require.Empty(d.t, diffs)
}

// TestCrashAtEachFailpoint crashes a worker process at each failpoint,
// starts a fresh one, and requires the outcome of a run without a crash.
// At step-after-call a worker dies after a charge took effect at the
// payment service and before it recorded that: the charge's outcome is
// unknown, its next attempt asks again under the same key, and the order
// ships, charged once.
func TestCrashAtEachFailpoint(t *testing.T) {
	t.Parallel()
	for _, fp := range []string{failpoint.StepAfterInbox, failpoint.StepAfterCall, failpoint.StepBeforeAck, failpoint.OrchestratorBeforeAck, failpoint.RelayBeforeMark, failpoint.LeaseTakeover} {
		t.Run(fp, func(t *testing.T) {
			t.Parallel()
			d := newDeployment(t)
			credited, compensated := d.submit(20)
			if fp == failpoint.LeaseTakeover {
				// Lose some commands on the way to the broker, so their
				// leases expire and are taken over.
				_, err := d.pool.Exec(context.Background(), `update idemsaga.outbox set published_at = now() where id % 3 = 0`)
				require.NoError(t, err)
			}
			crashing := d.startWorker(fp + "=exit*1")
			require.Equal(t, failpoint.ExitCode, crashing.wait(t, 60*time.Second), crashing.stderr.String())
			require.Contains(t, crashing.stderr.String(), "failpoint "+fp)

			fresh := d.startWorker("")
			d.waitFinished(90*time.Second, crashing, fresh)
			fresh.stop(t)
			d.check(credited, compensated)
		})
	}
}

// TestCrashAfterStartCommits: the client process dies after its start
// committed and before it learned the saga's ID. Retrying with the same key
// finds the saga; it runs once.
func TestCrashAfterStartCommits(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	args := []string{"transfer", "--from", "1", "--to", "2", "--amount", "7", "--key", "lost-answer"}
	r := worker(t, append(d.env, failpoint.EnvVar+"="+failpoint.StartAfterCommit+"=exit"), args...)
	require.Equal(t, failpoint.ExitCode, r.code, r.stderr)
	require.Empty(t, strings.TrimSpace(r.stdout), "the caller never got its answer")

	w := d.startWorker("")
	r = worker(t, d.env, append(args, "--wait")...)
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stderr, "already names this saga")
	require.Contains(t, r.stdout, "credited")
	w.stop(t)
	d.check(1, 0)
}

// TestBulkCancelWithTheWorkerKilled: the only worker dies in the middle
// of a step (its claim made, its transaction open); an operator cancels
// every transfer and order in bulk from the admin commands while no
// worker runs, then sends the same command again, which replays instead
// of cancelling again. A fresh worker carries the cancels out: money and
// stock conserved, every charge refunded once, no invariant broken.
func TestBulkCancelWithTheWorkerKilled(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	d.submit(10)
	crashing := d.startWorker(failpoint.StepAfterInbox + "=exit*1")
	require.Equal(t, failpoint.ExitCode, crashing.wait(t, 60*time.Second), crashing.stderr.String())

	type item struct {
		ID       string `json:"id"`
		Before   string `json:"before"`
		State    string `json:"state"`
		Replayed bool   `json:"replayed"`
		Error    string `json:"error"`
	}
	bulk := func(definition string) []item {
		r := worker(t, d.env, "cancel", "--definition", definition, "--request-key", "incident-9", "--reason", "worker lost", "--json")
		var out struct {
			Items []item `json:"items"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout+r.stderr)
		return out.Items
	}
	for _, def := range []string{"transfer", "order"} {
		first := bulk(def)
		require.NotEmpty(t, first)
		cancelled := map[string]bool{}
		for _, it := range first {
			if it.Error != "" {
				// One the crashing worker finished before it died.
				require.Contains(t, it.Error, "the saga's state does not allow this", it.Error)
				continue
			}
			require.False(t, it.Replayed)
			cancelled[it.ID] = true
		}
		require.NotEmpty(t, cancelled)
		t.Logf("%s: %d sagas, %d cancelled with no worker running, %d refused (finished before the crash)", def, len(first), len(cancelled), len(first)-len(cancelled))
		for _, it := range bulk(def) {
			if cancelled[it.ID] {
				require.True(t, it.Replayed, "saga %s: the resend replays its cancel", it.ID)
			} else {
				require.NotEmpty(t, it.Error, "saga %s: nothing new is cancelled by a resend", it.ID)
			}
		}
		var recorded int
		require.NoError(t, d.pool.QueryRow(context.Background(), `select count(*) from idemsaga.repairs r join idemsaga.sagas s on s.id = r.saga_id
where s.definition = $1 and r.request_key like 'incident-9/%'`, def).Scan(&recorded))
		require.Equal(t, len(cancelled), recorded)
	}

	fresh := d.startWorker("")
	ctx := context.Background()
	// Once it runs (the cancels may have left it nothing to do).
	require.Eventually(t, func() bool {
		var n int
		_ = d.pool.QueryRow(ctx, `select count(*) from idemsaga.workers where pid = $1`, fresh.cmd.Process.Pid).Scan(&n)
		return n == 1
	}, 60*time.Second, 20*time.Millisecond, "the fresh worker registers")
	d.waitFinished(90*time.Second, crashing, fresh)
	fresh.stop(t)
	rep, err := transfer.Audit(ctx, d.pool, d.seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	ord, err := order.Audit(ctx, d.pool)
	require.NoError(t, err)
	require.Empty(t, ord.Differences)
	diffs, err := engine.Reconcile(ctx, d.pool, []*saga.Definition{d.def, d.order}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}
