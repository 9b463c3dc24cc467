package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

var workerBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemsaga-worker-bin-")
	if err != nil {
		panic(err)
	}
	workerBin = filepath.Join(dir, "worker")
	if out, err := exec.Command("go", "build", "-race", "-o", workerBin, ".").CombinedOutput(); err != nil {
		os.Stderr.Write(out)
		panic(err)
	}
	testenv.AfterTests(func() { os.RemoveAll(dir) })
	testenv.Main(m, transfer.Migrate, order.Migrate, payments.Migrate, crossborder.Migrate, settlement.Migrate)
}

type result struct {
	stdout, stderr string
	code           int
}

func worker(t *testing.T, env []string, args ...string) result {
	t.Helper()
	r := testenv.Exec(t, 2*time.Minute, workerBin, env, args...)
	return result{r.Stdout, r.Stderr, r.Code}
}

func TestWorkerCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, dbURL := testenv.DBWithURL(t)
	srv, _ := testenv.NATS(t)
	stream := testenv.Name("CLI")
	env := []string{"DATABASE_URL=" + dbURL, "NATS_URL=" + srv.ClientURL(), "IDEMSAGA_STREAM=" + stream, "IDEMSAGA_SUBJECT_PREFIX=cli." + stream, "IDEMSAGA_LEASE_GRACE=5s"}
	_, err := transfer.Seed(ctx, pool, 3, 100, 3)
	require.NoError(t, err)

	r := worker(t, env, "migrate")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "deployment: stream "+stream)

	httpAddr := freeAddr(t)
	run := exec.Command(workerBin, "run", "--max-conns", "6", "--http-addr", httpAddr)
	run.Env = append(os.Environ(), env...)
	var runErr bytes.Buffer
	run.Stderr = &runErr
	require.NoError(t, run.Start())
	exited := make(chan error, 1)
	go func() { exited <- run.Wait() }()
	t.Cleanup(func() {
		_ = run.Process.Kill()
	})

	r = worker(t, env, "transfer", "--from", "1", "--to", "2", "--amount", "10", "--key", "T-1", "--wait")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Fields(r.stdout)
	require.Len(t, lines, 2, r.stdout)
	id, err := uuid.Parse(lines[0])
	require.NoError(t, err)
	require.Equal(t, "credited", lines[1])

	r = worker(t, env, "transfer", "--from", "1", "--to", "2", "--amount", "10", "--key", "T-1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, id.String(), strings.TrimSpace(r.stdout), "the same key gives the same saga")
	require.Contains(t, r.stderr, "already names this saga")

	r = worker(t, env, "transfer", "--from", "1", "--to", "2", "--amount", "11", "--key", "T-1")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "different details")

	r = worker(t, env, "transfer", "--from", "1", "--to", "3", "--amount", "10", "--key", "T-2", "--wait")
	require.Equal(t, 3, r.code, "a saga that ends compensated exits 3: %s", r.stderr)
	require.Contains(t, r.stdout, "compensated")
	require.Contains(t, r.stderr, "ended compensated, not credited")

	r = worker(t, env, "status", "T-1", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var st struct {
		ID    uuid.UUID `json:"id"`
		Key   string    `json:"key"`
		State string    `json:"state"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
	require.Equal(t, id, st.ID)
	require.Equal(t, "T-1", st.Key)
	require.Equal(t, "credited", st.State)

	r = worker(t, env, "show", id.String())
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "credited")
	require.Contains(t, r.stdout, "timeline:")
	require.Regexp(t, `credit\s+forward\s+1\s+succeeded`, r.stdout)

	r = worker(t, env, "list", "--state", "compensated", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var listed struct {
		Sagas []struct {
			Key string `json:"key"`
		} `json:"sagas"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &listed))
	require.Len(t, listed.Sagas, 1)
	require.Equal(t, "T-2", listed.Sagas[0].Key)

	r = worker(t, env, "retry", id.String())
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "there is nothing to retry")

	r = worker(t, env, "transfer", "--from", "1", "--to", "2", "--amount=-5", "--key", "bad")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "amount must be positive")

	// The worker's metrics tell what it did: two sagas finished, one
	// completed and one compensated, through these step attempts.
	metrics := scrape(t, "http://"+httpAddr+"/metrics")
	for series, want := range map[string]float64{
		`idemsaga_sagas_finished_total{definition="transfer",outcome="completed"}`:                                 1,
		`idemsaga_sagas_finished_total{definition="transfer",outcome="compensated"}`:                               1,
		`idemsaga_step_attempts_total{definition="transfer",outcome="succeeded",phase="forward",step="deduct"}`:    2,
		`idemsaga_step_attempts_total{definition="transfer",outcome="succeeded",phase="forward",step="credit"}`:    1,
		`idemsaga_step_attempts_total{definition="transfer",outcome="failed",phase="forward",step="credit"}`:       1,
		`idemsaga_step_attempts_total{definition="transfer",outcome="succeeded",phase="compensate",step="deduct"}`: 1,
		`idemsaga_outbox_backlog_rows`: 0,
	} {
		require.Contains(t, metrics, series, "metric %s missing", series)
		require.Equal(t, want, metrics[series], series)
	}
	require.Equal(t, 2.0, metrics[`idemsaga_saga_duration_seconds_count{definition="transfer",outcome="completed"}`]+metrics[`idemsaga_saga_duration_seconds_count{definition="transfer",outcome="compensated"}`])
	require.Equal(t, "ok\n", get(t, "http://"+httpAddr+"/healthz"))
	require.Equal(t, "ready\n", get(t, "http://"+httpAddr+"/readyz"))

	// The HTTP API on the same address: a start, its replay, and a key the
	// CLI already used for another transfer.
	post := func(key, body string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, "http://"+httpAddr+"/v1/sagas/transfer", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	code, first := post("H-1", `{"from":2,"to":1,"amount":4}`)
	require.Equal(t, http.StatusCreated, code, first)
	code, again := post("H-1", `{"from":2,"to":1,"amount":4}`)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, first, again, "a replay answers byte for byte")
	code, _ = post("T-1", `{"from":1,"to":2,"amount":999}`)
	require.Equal(t, http.StatusUnprocessableEntity, code)
	var started struct {
		ID string `json:"id"`
	}
	require.NoError(t, json.Unmarshal([]byte(first), &started))
	require.Eventually(t, func() bool {
		return strings.Contains(get(t, "http://"+httpAddr+"/v1/sagas/"+started.ID), `"state":"credited"`)
	}, 30*time.Second, 50*time.Millisecond)

	// The console on the same address, and the figures it polls: this
	// worker's counters.
	require.Contains(t, get(t, "http://"+httpAddr+"/ui/"), "<title>idemsaga console</title>")
	require.Eventually(t, func() bool {
		var stats struct {
			Finished map[string]int `json:"sagas_finished"`
		}
		require.NoError(t, json.Unmarshal([]byte(get(t, "http://"+httpAddr+"/v1/stats")), &stats))
		return stats.Finished["completed"] == 2 && stats.Finished["compensated"] == 1
	}, 30*time.Second, 50*time.Millisecond)

	// SIGTERM drains and exits cleanly.
	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, runErr.String())
	case <-time.After(45 * time.Second):
		t.Fatal("worker run did not stop within 45s of SIGTERM")
	}
	require.Contains(t, runErr.String(), "stopped cleanly")
}

// TestSeed: `worker seed` gives a migrated database the examples'
// accounts and products and records them for reconcile; run again, it
// refuses and changes nothing unless told to replace them.
func TestSeed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, dbURL := testenv.DBWithURL(t)
	env := []string{"DATABASE_URL=" + dbURL}
	r := worker(t, env, "seed", "--accounts", "7", "--balance", "50", "--products", "3", "--stock", "9")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "seeded 7 accounts holding 350 in all, and 3 products of 9 units")
	var money, stock int64
	require.NoError(t, pool.QueryRow(ctx, `select (select sum(balance) from transfer.accounts), (select sum(stock) from orders.products)`).Scan(&money, &stock))
	require.Equal(t, []int64{350, 27}, []int64{money, stock})
	r = worker(t, env, "reconcile")
	require.Equal(t, 0, r.code, r.stdout+r.stderr)

	r = worker(t, env, "seed", "--accounts", "2")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "already holds 7 accounts and 3 products; pass --replace")
	require.NoError(t, pool.QueryRow(ctx, `select sum(balance) from transfer.accounts`).Scan(&money))
	require.Equal(t, int64(350), money, "nothing changed")
	r = worker(t, env, "seed", "--accounts", "2", "--replace")
	require.Equal(t, 0, r.code, r.stderr)
	require.NoError(t, pool.QueryRow(ctx, `select sum(balance) from transfer.accounts`).Scan(&money))
	require.Equal(t, int64(2_000_000), money)
}

func TestWorkerErrorsAreOneLine(t *testing.T) {
	t.Parallel()
	r := worker(t, []string{"DATABASE_URL=postgres://postgres@127.0.0.1:1/x?connect_timeout=2"}, "status", "x")
	require.Equal(t, 1, r.code)
	require.Equal(t, 1, strings.Count(strings.TrimSpace(r.stderr), "\n")+1, r.stderr)
	require.Contains(t, r.stderr, "cannot reach PostgreSQL")

	_, dbURL := testenv.DBWithURL(t)
	r = worker(t, []string{"DATABASE_URL=" + dbURL, "NATS_URL=nats://127.0.0.1:1"}, "run")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "cannot reach NATS")
	require.Equal(t, 1, strings.Count(strings.TrimSpace(r.stderr), "\n")+1, r.stderr)
}

// TestRunRefusesTransferTablesBehindTheirMigrations: `worker run` on a
// database whose transfer tables lack one of this build's migrations
// stops before it consumes anything, saying what to do (its debits would
// call a function that is not there); with --migrate it applies them.
func TestRunRefusesTransferTablesBehindTheirMigrations(t *testing.T) {
	t.Parallel()
	pool, dbURL := testenv.DBWithURL(t)
	_, err := pool.Exec(context.Background(), `update transfer.schema_version set version = version - 1`)
	require.NoError(t, err)
	r := worker(t, []string{"DATABASE_URL=" + dbURL, "NATS_URL=nats://127.0.0.1:1"}, "run", "--http-addr", "127.0.0.1:0")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "schema transfer")
	require.Contains(t, r.stderr, "apply the migrations first (the runtime's `worker migrate` command")

	// With --migrate (here from nothing: the version alone cannot be
	// lowered and applied again) the check passes, and the run goes on to
	// the broker (none here).
	_, err = pool.Exec(context.Background(), `drop schema transfer cascade`)
	require.NoError(t, err)
	r = worker(t, []string{"DATABASE_URL=" + dbURL, "NATS_URL=nats://127.0.0.1:1"}, "run", "--migrate", "--http-addr", "127.0.0.1:0")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "cannot reach NATS")
}

func TestDemo(t *testing.T) {
	t.Parallel()
	name := "idemsaga_demo_test_" + strings.ToLower(testenv.Name("d")[2:])
	t.Cleanup(func() {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, testenv.AdminURL())
		if err == nil {
			_, _ = conn.Exec(ctx, "drop database if exists "+name+" with (force)")
			_ = conn.Close(ctx)
		}
	})
	addr := freeAddr(t)
	cmd := exec.Command(workerBin, "demo", "--transfers", "60", "--db-name", name, "--serve", "--http-addr", addr)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+testenv.AdminURL())
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	// --serve keeps the metrics up after the summary.
	var metrics map[string]float64
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 2*time.Minute, 100*time.Millisecond, "demo serves its metrics")
	metrics = scrape(t, "http://"+addr+"/metrics")
	finished := 0.0
	for series, v := range metrics {
		if strings.HasPrefix(series, "idemsaga_sagas_finished_total") {
			finished += v
		}
	}
	require.Equal(t, 60.0, finished, "every saga finished, counted once across the pools")

	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	select {
	case err := <-done:
		require.NoError(t, err, out.String()+errb.String())
	case <-time.After(30 * time.Second):
		t.Fatal("demo --serve did not stop on SIGINT")
	}
	require.Contains(t, out.String(), "0 differences: engine and ledger invariants hold")
	require.Contains(t, out.String(), "money                    seeded")
	require.Contains(t, out.String(), "conserved")
	require.Contains(t, out.String(), "refused=true")
	require.Regexp(t, `latency\s+p50 \S+, p99 \S+`, out.String())
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	return string(b)
}

// scrape reads a Prometheus text exposition into series → value.
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, line := range strings.Split(get(t, url), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(t, err, line)
		out[line[:i]] = v
	}
	return out
}

// TestBench runs a small `worker bench`: it must finish with zero reconcile
// differences and report every figure. Performance itself is measured by
// running the command, never asserted here.
func TestBench(t *testing.T) {
	t.Parallel()
	name := "idemsaga_bench_test_" + strings.ToLower(testenv.Name("b")[2:])
	t.Cleanup(func() {
		ctx := context.Background()
		if conn, err := pgx.Connect(ctx, testenv.AdminURL()); err == nil {
			_, _ = conn.Exec(ctx, "drop database if exists "+name+" with (force)")
			_ = conn.Close(ctx)
		}
	})
	r := worker(t, []string{"DATABASE_URL=" + testenv.AdminURL()}, "bench", "--sagas", "150", "--warm-up", "20", "--concurrency", "8", "--max-conns", "5", "--pgbench-seconds", "1", "--lost-acks", "1", "--db-name", name)
	require.Equal(t, 0, r.code, r.stdout+r.stderr)
	require.Contains(t, r.stdout, "100% delivered again after a lost ack")
	// Every command was delivered twice: each second delivery was absorbed
	// by a worker's memory or the inbox (the last ones may come after the
	// measured part), and the money still adds up (reconcile, below).
	m := regexp.MustCompile(`absorbed per saga: ([0-9.]+) at the start, [0-9.]+ by the broker, ([0-9.]+) by the step workers' memory, ([0-9.]+) by the inbox`).FindStringSubmatch(r.stdout)
	require.NotNil(t, m, r.stdout)
	memory, _ := strconv.ParseFloat(m[2], 64)
	inbox, _ := strconv.ParseFloat(m[3], 64)
	// One command per saga crosses the broker, its first step's: the step
	// that step's transaction dispatches runs at once in the same process.
	require.InDelta(t, 1.0, memory+inbox, 0.3, "about one command per saga, each delivered again")
	require.Contains(t, r.stdout, "after a warm-up of 20")
	require.Contains(t, r.stdout, "2 pools of 5 connections")
	for _, figure := range []string{"throughput", "latency", "commits and", "found in them per saga", "messages per saga", "CPU per saga", "pgbench ceiling", "ratio"} {
		require.Contains(t, r.stdout, figure)
	}
	require.Regexp(t, `reconcile\s+0 differences`, r.stdout)

	// Bad input is refused before anything is written.
	r = worker(t, []string{"DATABASE_URL=" + testenv.AdminURL()}, "bench", "--warm-up=-1", "--db-name", name+"_bad")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "--warm-up not negative")
	for _, bad := range []string{"-1", "5000000000"} {
		r = worker(t, []string{"DATABASE_URL=" + testenv.AdminURL()}, "bench", "--max-conns="+bad, "--db-name", name+"_bad")
		require.Equal(t, 1, r.code)
		require.Contains(t, r.stderr, "--max-conns "+bad+": give each pool's database connections, from 1 to 1000")
	}
}
