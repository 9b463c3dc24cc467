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

	"github.com/alecthomas/kong"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/failpoint"
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
	LogLevel      string `name:"log-level" env:"LOG_LEVEL" default:"info" enum:"debug,info,warn,error" help:"Log level (debug, info, warn, error)."`
}

type cli struct {
	globals

	Migrate   migrateCmd   `cmd:"" help:"Create or update the engine's and the transfer example's tables."`
	Run       runCmd       `cmd:"" help:"Run a worker: outbox relay, step workers, orchestrator and lease reaper, until SIGINT or SIGTERM."`
	Transfer  transferCmd  `cmd:"" help:"Start a money transfer saga (the same key gives the same saga)."`
	Status    statusCmd    `cmd:"" help:"Show a saga by ID or idempotency key."`
	Reconcile reconcileCmd `cmd:"" help:"Check the engine's and the transfer example's invariants; print each difference and exit non-zero when any is found."`
	Demo      demoCmd      `cmd:"" help:"Run the transfer demo on embedded defaults: an in-process NATS server and a fresh demo database."`
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
