// Package e2e runs idemsaga as a user does: a module of the user's own
// (testdata/shop, which imports only idemsaga's public packages) builds
// its binary from a main of a dozen lines, and this test drives it
// through `run`, its HTTP API and its CLI, and through an admin binary
// that lacks the sagas' code.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) {
	// The two binaries are removed once the package's tests end.
	testenv.AfterTests(func() {
		if build.dir != "" {
			_ = os.RemoveAll(build.dir)
		}
	})
	testenv.Main(m)
}

var build struct {
	once       sync.Once
	dir        string
	shop, adm  string
	err        error
	buildLines string
}

// binaries builds the user's two binaries once per test process, into a
// folder TestMain removes.
func binaries(t *testing.T) (shop, admin string) {
	t.Helper()
	build.once.Do(func() {
		build.dir, build.err = os.MkdirTemp("", "idemsaga-e2e")
		if build.err != nil {
			return
		}
		build.shop, build.adm = filepath.Join(build.dir, "shop"), filepath.Join(build.dir, "shopadmin")
		cmd := exec.Command("go", "build", "-o", build.dir, "./cmd/shop", "./cmd/shopadmin")
		cmd.Dir = "testdata/shop"
		cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
		out, err := cmd.CombinedOutput()
		if err != nil {
			build.err = fmt.Errorf("go build the user's module: %v\n%s", err, out)
		}
	})
	require.NoError(t, build.err)
	return build.shop, build.adm
}

// lockedBuffer is a process's stderr, read while the process writes it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type result struct {
	stdout, stderr string
	code           int
}

func runCmd(t *testing.T, bin string, env []string, args ...string) result {
	t.Helper()
	r := testenv.Exec(t, time.Minute, bin, env, args...)
	return result{r.Stdout, r.Stderr, r.Code}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

type api struct {
	t     *testing.T
	base  string
	token string
}

func (a api) do(method, path, key, body string) (int, http.Header, string) {
	a.t.Helper()
	req, err := http.NewRequest(method, a.base+path, strings.NewReader(body))
	require.NoError(a.t, err)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if a.token != "" {
		req.Header.Set("Authorization", "Bearer "+a.token)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(a.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(a.t, err)
	return resp.StatusCode, resp.Header, string(b)
}

func (a api) state(id string) string {
	a.t.Helper()
	code, _, body := a.do(http.MethodGet, "/v1/sagas/"+id, "", "")
	require.Equal(a.t, http.StatusOK, code, body)
	var sg struct {
		State string `json:"state"`
	}
	require.NoError(a.t, json.Unmarshal([]byte(body), &sg))
	return sg.State
}

func (a api) waitState(id, want string) {
	a.t.Helper()
	require.Eventually(a.t, func() bool { return a.state(id) == want }, 30*time.Second, 20*time.Millisecond, "saga %s never reached %s (now %s)", id, want, a.state(id))
}

func TestUsersOwnSagaThroughRunHTTPAndCLI(t *testing.T) {
	shop, admin := binaries(t)
	pool, dbURL := testenv.DBWithURL(t)
	srv, _ := testenv.NATS(t)
	dir := t.TempDir()
	bankUp := filepath.Join(dir, "bank-up")
	tokens := filepath.Join(dir, "tokens")
	const token = "s3cret-token-for-the-shop-0123456789"
	require.NoError(t, os.WriteFile(tokens, []byte("# the shop's API tokens\n"+token+"\n"), 0o600))
	stream := testenv.Name("SHOP")
	env := []string{"DATABASE_URL=" + dbURL, "NATS_URL=" + srv.ClientURL(), "IDEMSAGA_STREAM=" + stream,
		"IDEMSAGA_SUBJECT_PREFIX=shop." + stream, "SHOP_BANK_UP=" + bankUp}

	r := runCmd(t, shop, env, "migrate")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "schema shop at version 1")
	require.Contains(t, r.stdout, "definitions order")

	addr := freeAddr(t)
	run := exec.Command(shop, "run", "--http-addr", addr, "--api-tokens-file", tokens, "--max-conns", "8")
	run.Env = append(os.Environ(), env...)
	runErr := &lockedBuffer{}
	run.Stderr = runErr
	require.NoError(t, run.Start())
	exited := make(chan error, 1)
	go func() { exited <- run.Wait() }()
	t.Cleanup(func() { _ = run.Process.Kill() })
	open := api{t: t, base: "http://" + addr}
	authed := api{t: t, base: "http://" + addr, token: token}
	require.Eventually(t, func() bool {
		resp, err := http.Get(open.base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "shop run never became ready: %s", runErr.String())

	// Without the token: 401, and nothing written; /healthz stays open,
	// /metrics needs the token.
	body := `{"item":"book","quantity":1,"card":"ok"}`
	code, hdr, problem := open.do(http.MethodPost, "/v1/sagas/order", "o-1", body)
	require.Equal(t, http.StatusUnauthorized, code, problem)
	require.Equal(t, "application/problem+json", hdr.Get("Content-Type"))
	code, _, _ = (api{t: t, base: open.base, token: "wrong-token-0123456789abcdef"}).do(http.MethodPost, "/v1/sagas/order", "o-1", body)
	require.Equal(t, http.StatusUnauthorized, code)
	var sagas int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas`).Scan(&sagas))
	require.Zero(t, sagas, "a refused request writes nothing")
	code, _, _ = open.do(http.MethodGet, "/healthz", "", "")
	require.Equal(t, http.StatusOK, code)
	code, _, _ = open.do(http.MethodGet, "/metrics", "", "")
	require.Equal(t, http.StatusUnauthorized, code)
	code, _, metrics := authed.do(http.MethodGet, "/metrics", "", "")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, metrics, "idemsaga_")

	// A new saga, its replay, a smuggled field, a validator's refusal and
	// an unknown definition.
	code, _, first := authed.do(http.MethodPost, "/v1/sagas/order", "o-1", body)
	require.Equal(t, http.StatusCreated, code, first)
	code, hdr, again := authed.do(http.MethodPost, "/v1/sagas/order", "o-1", `{"card":"ok","quantity":1,"item":"book"}`)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "true", hdr.Get("Idempotent-Replayed"))
	require.Equal(t, first, again, "byte-identical replay")
	var started struct{ ID, Definition, Key, State string }
	require.NoError(t, json.Unmarshal([]byte(first), &started))
	require.Equal(t, []string{"order", "o-1", "init"}, []string{started.Definition, started.Key, started.State})
	authed.waitState(started.ID, "charged")
	code, _, problem = authed.do(http.MethodPost, "/v1/sagas/order", "o-2", `{"item":"book","quantity":1,"QUANTITY":500,"card":"ok"}`)
	require.Equal(t, http.StatusBadRequest, code, problem)
	code, _, problem = authed.do(http.MethodPost, "/v1/sagas/order", "o-3", `{"item":"book","quantity":0,"card":"ok"}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, problem, "quantity must be at least 1")
	code, _, _ = authed.do(http.MethodPost, "/v1/sagas/refund", "o-4", body)
	require.Equal(t, http.StatusNotFound, code)

	// 50 concurrent POSTs with one key: one saga.
	var wg sync.WaitGroup
	gate := make(chan struct{})
	codes := make([]int, 50)
	bodies := make([]string, 50)
	for i := range 50 {
		wg.Go(func() {
			<-gate
			codes[i], _, bodies[i] = authed.do(http.MethodPost, "/v1/sagas/order", "burst", `{"item":"pen","quantity":3,"card":"ok"}`)
		})
	}
	close(gate)
	wg.Wait()
	count := map[int]int{}
	var answer string
	for i, c := range codes {
		count[c]++
		if c == http.StatusCreated || c == http.StatusOK {
			if answer == "" {
				answer = bodies[i]
			}
			require.Equal(t, answer, bodies[i])
		}
	}
	require.Equal(t, 1, count[http.StatusCreated], "%v", count)
	require.Equal(t, 50, count[http.StatusCreated]+count[http.StatusOK]+count[http.StatusConflict], "%v", count)
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas where idem_key = 'burst'`).Scan(&sagas))
	require.Equal(t, 1, sagas)
	t.Logf("50 concurrent POSTs with one key: %d created, %d replayed, %d in flight (409)", count[201], count[200], count[409])

	// The admin binary has no saga code: it starts a saga from the
	// deployment's record, which the worker runs, and shows it.
	r = runCmd(t, admin, env, "start", "order", "--key", "o-cli", "--input", `{"item":"mug","quantity":2,"card":"ok"}`, "--wait")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "charged")
	r = runCmd(t, admin, env, "start", "order", "--key", "o-cli", "--input", `{"item":"mug","quantity":2,"card":"ok","card":"stolen"}`)
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "appears twice")
	r = runCmd(t, admin, env, "workers")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "1 live workers")

	// Cancel through the admin binary: a charge the bank keeps refusing
	// (retried in a minute) is cancelled, and the worker releases the
	// reservation. The same request sent again changes nothing.
	code, _, slow := authed.do(http.MethodPost, "/v1/sagas/order", "o-slow", `{"item":"lamp","quantity":1,"card":"slow"}`)
	require.Equal(t, http.StatusCreated, code, slow)
	require.NoError(t, json.Unmarshal([]byte(slow), &started))
	require.Eventually(t, func() bool {
		var n int
		_ = pool.QueryRow(context.Background(), `select count(*) from idemsaga.steps where saga_id = $1 and step = 'charge' and status = 'retrying'`, started.ID).Scan(&n)
		return n == 1
	}, 30*time.Second, 20*time.Millisecond)
	r = runCmd(t, admin, env, "cancel", "o-slow", "--reason", "customer changed their mind", "--request-key", "ticket-1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "cancelled")
	authed.waitState(started.ID, "compensated")
	var reserved int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from shop.reservations where item = 'lamp'`).Scan(&reserved))
	require.Zero(t, reserved, "the worker released the reservation")
	r = runCmd(t, admin, env, "cancel", "o-slow", "--reason", "customer changed their mind", "--request-key", "ticket-1")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "already cancelled by this request")

	// Retry through the admin binary: a charge whose answers were lost is
	// possibly done and has no compensation, so the saga parks; once the
	// bank answers again, retry runs it again under the same key.
	code, _, lossy := authed.do(http.MethodPost, "/v1/sagas/order", "o-lossy", `{"item":"desk","quantity":1,"card":"lossy"}`)
	require.Equal(t, http.StatusCreated, code, lossy)
	require.NoError(t, json.Unmarshal([]byte(lossy), &started))
	authed.waitState(started.ID, "parked")
	require.NoError(t, os.WriteFile(bankUp, nil, 0o600))
	r = runCmd(t, admin, env, "retry", started.ID)
	require.Equal(t, 0, r.code, r.stderr)
	authed.waitState(started.ID, "charged")
	r = runCmd(t, admin, env, "show", started.ID)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `charge\s+external\s+forward\s+succeeded\s+3`, r.stdout, "the third attempt, same key")

	// Cancel and retry over HTTP, under Idempotency-Key.
	code, _, refused := authed.do(http.MethodPost, "/v1/sagas/"+started.ID+"/cancel", "c-1", `{"reason":"too late"}`)
	require.Equal(t, http.StatusConflict, code, refused)
	require.Contains(t, refused, "charged")

	r = runCmd(t, admin, env, "reconcile")
	require.Equal(t, 0, r.code, r.stdout+r.stderr)
	require.Contains(t, r.stdout, "0 differences")

	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, runErr.String())
	case <-time.After(45 * time.Second):
		t.Fatal("shop run did not stop within 45s of SIGTERM")
	}
	require.NotContains(t, runErr.String(), token, "no token in the logs")
}

// TestRunRefusesAnOpenAddressWithoutTokens: a worker that would serve
// the API to other machines without tokens does not start, and says what
// to do; the NATS password in NATS_URL reaches no message.
func TestRunRefusesAnOpenAddressWithoutTokens(t *testing.T) {
	shop, _ := binaries(t)
	_, dbURL := testenv.DBWithURL(t)
	env := []string{"DATABASE_URL=" + dbURL}
	r := runCmd(t, shop, env, "run", "--http-addr", "0.0.0.0:0")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "no API tokens are configured")

	r = runCmd(t, shop, append(env, "NATS_URL=nats://shop:hunter2-secret@127.0.0.1:1"), "migrate")
	require.Equal(t, 0, r.code, r.stderr)
	r = runCmd(t, shop, append(env, "NATS_URL=nats://shop:hunter2-secret@127.0.0.1:1"), "run", "--http-addr", "")
	require.Equal(t, 1, r.code)
	require.Contains(t, r.stderr, "cannot reach NATS at nats://shop:xxxxx@127.0.0.1:1")
	require.NotContains(t, r.stderr, "hunter2")
	r = runCmd(t, shop, append(env, "NATS_URL=nats://hunter2-token@127.0.0.1:1"), "run", "--http-addr", "")
	require.Equal(t, 1, r.code)
	require.NotContains(t, r.stderr, "hunter2")
}
