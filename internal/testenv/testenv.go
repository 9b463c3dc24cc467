// Package testenv gives tests real infrastructure, isolated per test: a
// PostgreSQL database in a migrated template's state (cloned from it, or
// an earlier test's brought back to it), and an
// in-process NATS server with JetStream in a temporary folder.
//
// PostgreSQL is found through TEST_DATABASE_URL, then DATABASE_URL, then
// postgres://postgres@127.0.0.1:5432/postgres. Missing infrastructure fails
// the test; it never skips.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/internal/testdb"
	"github.com/idemsaga/idemsaga/migrations"
)

// AdminURL returns the URL of the maintenance database.
func AdminURL() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// Migrator creates or updates a package's own tables, such as an
// example's (transfer.Migrate).
type Migrator func(ctx context.Context, conn *pgx.Conn) error

// tables are the migrators a test process added to the engine's.
var tables []Migrator

// WithTables adds, to every test database of this process, the tables the
// migrators create next to the engine's. Call it from TestMain before
// m.Run (Main does).
func WithTables(migrate ...Migrator) { tables = append(tables, migrate...) }

func randomSuffix() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// template returns the process's template: the engine's migrations and
// the process's own tables (WithTables) applied.
func template(ctx context.Context) (*testdb.Template, error) {
	return testdb.Get(ctx, AdminURL(), "idemsaga_test", "testenv", func(ctx context.Context, conn *pgx.Conn) error {
		if err := migrations.Migrate(ctx, conn); err != nil {
			return err
		}
		for _, m := range tables {
			if err := m(ctx, conn); err != nil {
				return err
			}
		}
		return nil
	})
}

// afterTests are what Main runs once the tests ended (AfterTests).
var afterTests []func()

// AfterTests adds f to what Main runs once every test of the process
// ended, before it looks for leaked goroutines: removing a folder the
// tests shared, for example. Call it from TestMain before Main.
func AfterTests(f func()) { afterTests = append(afterTests, f) }

// Main runs a package's tests, drops the template database, runs what
// AfterTests added, and fails the run when goroutines leak. Call it from
// TestMain: testenv.Main(m), with the migrators of the tables the tests
// need besides the engine's (testenv.Main(m, transfer.Migrate)).
func Main(m *testing.M, migrate ...Migrator) {
	WithTables(migrate...)
	ignore := goleak.IgnoreCurrent()
	testdb.Manage()
	code := m.Run()
	Cleanup()
	for _, f := range afterTests {
		f()
	}
	if code == 0 {
		if err := goleak.Find(ignore); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Cleanup drops the process's template and test databases, and says how
// many databases its tests took. Call it from TestMain after m.Run (Main
// does).
func Cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if line := testdb.Cleanup(ctx, AdminURL()); line != "" && os.Getenv("IDEMSAGA_TESTENV_QUIET") == "" {
		fmt.Fprintln(os.Stderr, "testenv:", line)
	}
}

// DB returns a pool on a database of the test's own holding the engine's
// tables and the process's own (WithTables), as the template has them:
// a new one, or one an earlier test of the process used and that was
// brought back to the template's state (see reuse).
func DB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, _ := DBWithURL(t)
	return pool
}

// DBWithURL is DB that also returns the database's connection string, for
// tests that start worker processes.
func DBWithURL(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tp, err := template(ctx)
	if err != nil {
		t.Fatalf("testenv: PostgreSQL is required: %v", err)
	}
	name, err := tp.Take(ctx)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	url, err := testdb.URL(AdminURL(), name)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("testenv: open pool: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := tp.Release(ctx, name); err != nil {
			t.Errorf("testenv: release test database %s: %v", name, err)
		}
	})
	return pool, url
}

// NATS starts an in-process NATS server with JetStream on a free loopback
// port, storing in a temporary folder, and returns it with a connection.
// Both are shut down when the test ends.
func NATS(t testing.TB) (*natsserver.Server, *nats.Conn) {
	t.Helper()
	srv := StartNATS(t, t.TempDir(), -1)
	nc := Connect(t, srv.ClientURL())
	return srv, nc
}

// StartNATS starts a JetStream server storing in dir on port (-1: any).
func StartNATS(t testing.TB, dir string, port int) *natsserver.Server {
	t.Helper()
	srv, err := natsserver.NewServer(&natsserver.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true,
	})
	if err != nil {
		t.Fatalf("testenv: nats server: %v", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("testenv: nats server did not become ready")
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return srv
}

// StartNATSAt starts a JetStream server storing in dir on the host:port
// addr of an earlier server, so its clients reconnect to it.
func StartNATSAt(t testing.TB, dir, addr string) *natsserver.Server {
	t.Helper()
	_, portText, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		t.Fatal(err)
	}
	return StartNATS(t, dir, port)
}

// Connect opens a client connection closed when the test ends.
func Connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatalf("testenv: connect to nats: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Name returns a unique stream name for a test.
func Name(prefix string) string { return prefix + "_" + strings.ToUpper(randomSuffix()) }

// WaitForLockWaiters waits until n sessions of pool's database wait on a
// lock (a second delivery blocked on a key the first still holds, say),
// and fails the test after 10 seconds.
func WaitForLockWaiters(t testing.TB, pool *pgxpool.Pool, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := pool.QueryRow(context.Background(), `select count(*) from pg_stat_activity
  where datname = current_database() and wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			t.Fatalf("count sessions waiting on a lock: %v", err)
		}
		if waiting == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions wait on a lock after 10s, want %d", waiting, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
