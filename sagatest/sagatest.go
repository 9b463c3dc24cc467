package sagatest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/internal/testdb"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

// DatabaseURLDefault is the server the kit creates its databases on when
// neither SAGATEST_DATABASE_URL nor DATABASE_URL is set.
const DatabaseURLDefault = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// TimeoutDefault bounds Run and Wait, in wall time.
const TimeoutDefault = 30 * time.Second

// Config describes what a test runs. Only Definitions is required.
type Config struct {
	// Definitions are the sagas the engine runs. Required.
	Definitions []*saga.Definition
	// Migrations are the test's own tables, applied after the engine's.
	Migrations []service.Migration
	// Setup, if set, runs on the migrated database before the engine
	// starts (to seed rows, say).
	Setup func(ctx context.Context, pool *pgxpool.Pool) error
	// Timeout bounds Run and Wait, in wall time. Defaults to
	// TimeoutDefault.
	Timeout time.Duration
	// LeaseGrace is the engine's lease grace, on the test clock.
	// Defaults to 5s.
	LeaseGrace time.Duration
	// Logger receives the engine's logs. Defaults to none.
	Logger *slog.Logger
	// Registerer, if set, receives the engine's metrics.
	Registerer prometheus.Registerer
}

// Env is a real engine for one test: its own PostgreSQL database, an
// in-process JetStream server, and a clock the test moves.
type Env struct {
	// Pool is the test's database, which holds the engine's tables and
	// the test's own.
	Pool *pgxpool.Pool
	// Engine runs the definitions.
	Engine *engine.Engine
	// Client starts and reads sagas; its starts run in Engine at once.
	Client *engine.Client
	// Clock is the engine's clock.
	Clock *Clock
	// NATS is a connection to the in-process server.
	NATS *nats.Conn

	cfg    Config
	faults *attempt.Faults
	hooks  *testhook.Hooks
	url    string
	js     jetstream.JetStream
}

// kitStream is the stream of the kit's engine.
const kitStream = "SAGATEST"

// T is what the kit needs of a test: *testing.T and *testing.B have it.
type T interface {
	Helper()
	Cleanup(func())
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Fatal(args ...any)
	TempDir() string
}

// New starts an engine for cfg's definitions on a database of its own
// (created on the server of SAGATEST_DATABASE_URL, DATABASE_URL, or
// DatabaseURLDefault, and dropped when the test ends) with an in-process
// JetStream server. The test fails at once if PostgreSQL cannot be
// reached: the kit never skips.
func New(t T, cfg Config) *Env {
	t.Helper()
	if len(cfg.Definitions) == 0 {
		t.Fatal("sagatest: Config.Definitions is empty: give the kit the sagas to run")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = TimeoutDefault
	}
	if cfg.LeaseGrace <= 0 {
		cfg.LeaseGrace = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	env := &Env{cfg: cfg, faults: &attempt.Faults{}}
	env.hooks = &testhook.Hooks{Faults: env.faults}
	env.Pool, env.url = newDatabase(ctx, t, cfg.Migrations)
	env.Clock = &Clock{pool: env.Pool}
	if cfg.Setup != nil {
		if err := cfg.Setup(ctx, env.Pool); err != nil {
			t.Fatalf("sagatest: Config.Setup: %v", err)
		}
	}
	env.NATS = startNATS(t)
	js, err := jetstream.New(env.NATS)
	if err != nil {
		t.Fatalf("sagatest: %v", err)
	}
	env.js = js

	ecfg := engine.Config{
		Pool: env.Pool, NATS: env.NATS, Definitions: cfg.Definitions,
		Stream: kitStream, SubjectPrefix: "sagatest", LeaseGrace: cfg.LeaseGrace,
		ReapInterval: 5 * time.Millisecond, RelayPollInterval: 5 * time.Millisecond, RelayHandOff: 50 * time.Millisecond,
		ScheduleInterval: 5 * time.Millisecond, Logger: cfg.Logger, Registerer: cfg.Registerer,
		// Retention runs when the test says (Env.Clean), not behind it.
		Retention: engine.RetentionConfig{FinishedSagas: engine.KeepForever},
	}
	if err := engine.Deploy(ctx, ecfg); err != nil {
		t.Fatalf("sagatest: %v", err)
	}
	e, err := engine.New(ecfg)
	if err != nil {
		t.Fatalf("sagatest: %v", err)
	}
	env.Engine = e
	// The engine runs until the test ends, past New's own deadline, with
	// the kit's faults.
	if err := env.Engine.Start(testhook.With(context.WithoutCancel(ctx), env.hooks)); err != nil {
		t.Fatalf("sagatest: start the engine: %v", err)
	}
	env.Client = env.Engine.Client()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := env.Engine.Stop(sctx); err != nil {
			t.Errorf("sagatest: stop the engine: %v", err)
		}
	})
	return env
}

// Database returns a database of the test's own, as New makes it (the
// engine's tables, the migrations' and the test clock), with no engine
// running: for tests of a saga's SQL, audits and fixtures. It is dropped
// when the test ends (under Main, brought back to its first state and
// kept for the next test).
func Database(t T, ms ...service.Migration) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, _ := newDatabase(ctx, t, ms)
	return pool
}

// Run starts a saga of def under key with input and runs it to its end,
// skipping the time it would wait (see Wait). It returns the finished
// saga with its steps and every attempt.
func (e *Env) Run(t T, def *saga.Definition, key string, input any) *saga.Instance {
	t.Helper()
	res, err := e.Client.Start(context.Background(), def, key, input)
	if err != nil {
		t.Fatalf("sagatest: start %s %q: %v", def.Name(), key, err)
	}
	return e.Wait(t, res.ID)
}

// Wait waits until saga id finishes and returns it with its steps and
// every attempt. While the saga waits for time to pass (a retry's
// backoff, the lease of an attempt whose worker died), Wait moves the
// clock to the moment it waits for, so a saga that would take minutes
// finishes in milliseconds. It fails the test after Config.Timeout of
// wall time.
func (e *Env) Wait(t T, id uuid.UUID) *saga.Instance {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(e.cfg.Timeout)
	var last string
	quiet := time.Now()
	for {
		var sig *string
		var finished *bool
		err := e.Pool.QueryRow(ctx, signature, id).Scan(&sig, &finished)
		if err == nil && sig == nil {
			err = saga.ErrNotFound
		}
		if err != nil {
			t.Fatalf("sagatest: read saga %s: %v", id, err)
		}
		if *finished {
			sg, err := e.Client.Get(ctx, id)
			if err != nil {
				t.Fatalf("sagatest: read saga %s: %v", id, err)
			}
			return sg
		}
		if *sig != last {
			last, quiet = *sig, time.Now()
		} else if time.Since(quiet) > 20*time.Millisecond {
			if e.skip(ctx, t, id, time.Since(quiet)) {
				quiet = time.Now()
			}
		}
		if time.Now().After(deadline) {
			sg, _ := e.Client.Get(ctx, id)
			state := "unknown"
			if sg != nil {
				state = string(sg.State)
			}
			t.Fatalf("sagatest: saga %s still %s after %s of wall time (signature %s)", id, state, e.cfg.Timeout, *sig)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// CleanResult counts what one pass of the engine's retention deleted.
type CleanResult struct {
	// Sagas, Steps and Inbox are the finished sagas deleted, with their
	// step and inbox rows.
	Sagas, Steps, Inbox int64
	// Outbox is the published outbox rows deleted, SubmitTokens the
	// expired submit tokens.
	Outbox, SubmitTokens int64
}

// Clean runs the engine's retention once, with its default windows, on the
// test clock: move the clock past the retention window first to see what
// it deletes.
func (e *Env) Clean(t T) CleanResult {
	t.Helper()
	r := engine.RetentionConfig{}.WithDefaults()
	c := maintenance.NewCleaner(e.Pool, maintenance.CleanerConfig{FinishedSagas: r.FinishedSagas, PublishedOutbox: r.PublishedOutbox,
		BatchSize: r.BatchSize, Interval: r.Interval}, e.cfg.Logger)
	res, err := c.CleanOnce(context.Background())
	if err != nil {
		t.Fatalf("sagatest: clean: %v", err)
	}
	return CleanResult{Sagas: res.Sagas, Steps: res.Steps, Inbox: res.Inbox, Outbox: res.Outbox, SubmitTokens: res.SubmitTokens}
}

// DatabaseURL returns the connection string of the test's database, for
// a process the test starts.
func (e *Env) DatabaseURL() string { return e.url }

func adminURL() string {
	for _, k := range []string{"SAGATEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return DatabaseURLDefault
}

// newDatabase returns a database for the test with the engine's
// migrations and ms applied and the test clock in place. Under Main it is
// cloned from a template of the process (one per set of migrations) and
// brought back to it for the next test when this one ends; otherwise it
// is created, migrated, and dropped when the test ends.
func newDatabase(ctx context.Context, t T, ms []service.Migration) (*pgxpool.Pool, string) {
	t.Helper()
	var name string
	release := func(ctx context.Context) error {
		admin, err := pgx.Connect(ctx, adminURL())
		if err != nil {
			return err
		}
		defer admin.Close(ctx)
		_, err = admin.Exec(ctx, "drop database if exists "+name+" with (force)")
		return err
	}
	if testdb.Managed() {
		key, err := migrationsKey(ms)
		if err != nil {
			t.Fatalf("sagatest: read the migrations: %v", err)
		}
		tp, err := testdb.Get(ctx, adminURL(), "sagatest", key, func(ctx context.Context, conn *pgx.Conn) error { return migrate(ctx, conn, ms) })
		if err != nil {
			t.Fatalf("sagatest: PostgreSQL is required (set SAGATEST_DATABASE_URL or DATABASE_URL to a server where this user may create databases): %v", err)
		}
		if name, err = tp.Take(ctx); err != nil {
			t.Fatalf("sagatest: %v", err)
		}
		release = func(ctx context.Context) error { return tp.Release(ctx, name) }
	} else {
		name = testdb.Name("sagatest")
		admin, err := pgx.Connect(ctx, adminURL())
		if err != nil {
			t.Fatalf("sagatest: PostgreSQL is required (set SAGATEST_DATABASE_URL or DATABASE_URL to a server where this user may create databases): %v", err)
		}
		defer admin.Close(ctx)
		if _, err := admin.Exec(ctx, "create database "+name); err != nil {
			t.Fatalf("sagatest: create database %s: %v", name, err)
		}
	}
	cfg, err := pgxpool.ParseConfig(adminURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Database = name
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("sagatest: open database %s: %v", name, err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := release(ctx); err != nil {
			t.Errorf("sagatest: drop database %s: %v", name, err)
		}
	})
	if !testdb.Managed() {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatalf("sagatest: open database %s: %v", name, err)
		}
		defer conn.Release()
		if err := migrate(ctx, conn.Conn(), ms); err != nil {
			t.Fatalf("sagatest: migrate: %v", err)
		}
	}
	u := cfg.ConnConfig
	return pool, fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", u.User, u.Host, u.Port, name)
}

// migrationsKey names a set of migrations by their schemas, files and
// contents: the template a process keeps for them.
func migrationsKey(ms []service.Migration) (string, error) {
	h := sha256.New()
	for _, m := range ms {
		files, err := service.MigrationFiles(m)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "schema %s\x00", m.Schema)
		err = fs.WalkDir(files, ".", func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			b, err := fs.ReadFile(files, path)
			fmt.Fprintf(h, "%s\x00%d\x00", path, len(b))
			h.Write(b)
			return err
		})
		if err != nil {
			return "", err
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// migrate applies the engine's migrations and the test's, then replaces
// the engine's clock, idemsaga.now(), with one the test moves.
func migrate(ctx context.Context, conn *pgx.Conn, ms []service.Migration) error {
	if err := migrations.Migrate(ctx, conn); err != nil {
		return err
	}
	for _, m := range ms {
		files, err := service.MigrationFiles(m)
		if err != nil {
			return err
		}
		if err := migrations.Apply(ctx, conn, m.Schema, files); err != nil {
			return err
		}
	}
	_, err := conn.Exec(ctx, `create schema sagatest;
create table sagatest.clock (offset_ms bigint not null);
insert into sagatest.clock values (0);
create or replace function idemsaga.now() returns timestamptz language sql stable parallel safe
as $$ select pg_catalog.now() + (select offset_ms from sagatest.clock) * interval '1 millisecond' $$;`)
	return err
}

// startNATS starts an in-process JetStream server on a loopback port,
// shut down when the test ends, and connects to it.
func startNATS(t T) *nats.Conn {
	t.Helper()
	srv, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatalf("sagatest: nats server: %v", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("sagatest: nats server did not become ready")
	}
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatalf("sagatest: connect to nats: %v", err)
	}
	t.Cleanup(func() {
		nc.Close()
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return nc
}

// Main runs a package's tests (call it from TestMain) so that they share
// databases: each set of migrations is applied once, to a template the
// test databases are cloned from, and a database a test used is brought
// back to its first state for the next test instead of dropped (one
// whose tables, functions or settings the test changed is dropped). It
// drops them all once the tests ended, then exits with their code.
// Without Main every test creates, migrates and drops its own database.
//
//	func TestMain(m *testing.M) { sagatest.Main(m) }
func Main(m *testing.M) {
	testdb.Manage()
	code := m.Run()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testdb.Cleanup(ctx, adminURL())
	os.Exit(code)
}
