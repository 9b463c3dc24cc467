// Command worker runs idemsaga: worker processes, migrations, the transfer
// example's commands, inspection and a self-contained demo.
//
//	worker migrate
//	worker run
//	worker transfer --from 1 --to 2 --amount 100 --key T-1 --wait
//	worker status T-1 --json
//	worker demo
//
// Configuration comes from flags, with DATABASE_URL and NATS_URL as
// fallbacks.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/saga"
)

// DatabaseURLDefault is used when neither --database-url nor DATABASE_URL is set.
const DatabaseURLDefault = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// NATSURLDefault is used when neither --nats-url nor NATS_URL is set.
const NATSURLDefault = "nats://127.0.0.1:4222"

type globals struct {
	DatabaseURL string `name:"database-url" env:"DATABASE_URL" default:"${database_url}" help:"PostgreSQL connection string."`
	// Stream and SubjectPrefix must match across every worker and client
	// of one deployment: clients write the first command's subject.
	Stream        string `name:"stream" env:"IDEMSAGA_STREAM" default:"${stream}" help:"JetStream stream name."`
	SubjectPrefix string `name:"subject-prefix" env:"IDEMSAGA_SUBJECT_PREFIX" default:"${prefix}" help:"Prefix of every subject; the same for all workers and clients of a deployment."`
	// The transfer saga's policy and the lease grace are used by clients
	// too (they dispatch the first step and set its lease): give every
	// worker and client of a deployment the same values.
	StepTimeout time.Duration `name:"step-timeout" env:"IDEMSAGA_STEP_TIMEOUT" default:"30s" help:"Timeout of one attempt of a transfer step."`
	MaxAttempts int           `name:"max-attempts" env:"IDEMSAGA_MAX_ATTEMPTS" default:"5" help:"Attempts of a transfer step, the first included."`
	LeaseGrace  time.Duration `name:"lease-grace" env:"IDEMSAGA_LEASE_GRACE" default:"30s" help:"Added to a step's timeout to make its lease."`
	LogLevel    string        `name:"log-level" env:"LOG_LEVEL" default:"info" enum:"debug,info,warn,error" help:"Log level (debug, info, warn, error)."`
	LogFormat   string        `name:"log-format" env:"LOG_FORMAT" default:"text" enum:"text,json" help:"Log format (text or json)."`
}

type cli struct {
	globals

	Migrate   migrateCmd   `cmd:"" help:"Create or update the engine's and the transfer example's tables."`
	Run       runCmd       `cmd:"" help:"Run a worker: outbox relay, step workers, orchestrator and lease reaper, until SIGINT or SIGTERM."`
	Transfer  transferCmd  `cmd:"" help:"Start a money transfer saga (the same key gives the same saga)."`
	List      listCmd      `cmd:"" help:"List sagas, newest first, filtered by definition, state, age or stuckness."`
	Show      showCmd      `cmd:"" aliases:"status" help:"Show a saga by ID or idempotency key, with every step attempt."`
	Retry     retryCmd     `cmd:"" help:"Resume a failed saga's compensation (same step keys: nothing runs twice)."`
	Cancel    cancelCmd    `cmd:"" help:"Stop a running saga and compensate what it completed."`
	Reconcile reconcileCmd `cmd:"" help:"Check the engine's and the transfer example's invariants; print each difference and exit non-zero when any is found."`
	Demo      demoCmd      `cmd:"" help:"Run the transfer demo on embedded defaults: an in-process NATS server and a fresh demo database."`
	Chaos     chaosCmd     `cmd:"" help:"Run transfers across worker processes while killing, pausing and disconnecting them and restarting NATS; then reconcile."`
	Bench     benchCmd     `cmd:"" help:"Measure transfer sagas per second, latency and cost per saga against the local PostgreSQL, with pgbench as the ceiling."`
}

// definition returns the transfer saga with the configured policy.
func (g *globals) definition() (*saga.Definition, error) {
	if g.StepTimeout <= 0 || g.MaxAttempts < 1 || g.LeaseGrace <= 0 {
		return nil, fmt.Errorf("--step-timeout and --lease-grace must be positive and --max-attempts at least 1")
	}
	return transfer.NewDefinition(saga.RetryPolicy{Timeout: g.StepTimeout, MaxAttempts: g.MaxAttempts})
}

// client returns a saga client configured like the workers.
func (g *globals) client(pool *pgxpool.Pool) (*engine.Client, *saga.Definition, error) {
	def, err := g.definition()
	if err != nil {
		return nil, nil, err
	}
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, SubjectPrefix: g.SubjectPrefix, LeaseGrace: g.LeaseGrace})
	return cl, def, err
}

func main() {
	var c cli
	kctx := kong.Parse(&c,
		kong.Name("worker"),
		kong.Description("idemsaga worker: durable sagas with idempotent steps on PostgreSQL and NATS JetStream."),
		kong.UsageOnError(),
		kong.Vars{"database_url": DatabaseURLDefault, "nats_url": NATSURLDefault, "stream": engine.StreamDefault, "prefix": engine.SubjectPrefixDefault},
	)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	kctx.BindTo(ctx, (*context.Context)(nil))
	if err := failpoint.FromEnv(); err != nil {
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		os.Exit(2)
	}
	if err := kctx.Run(&c.globals); err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", kctx.Command(), err)
		stop()
		os.Exit(1)
	}
}
