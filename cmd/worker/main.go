// Command worker runs idemsaga with its examples (transfer and order):
// worker processes, migrations, the examples' commands, the order
// example's payment service, inspection and a self-contained demo.
//
//	worker migrate
//	worker run
//	worker transfer --from 1 --to 2 --amount 100 --key T-1 --wait
//	worker payments &
//	worker order --customer ann --product 1 --quantity 2 --amount 1500 --address '1 Main St' --key O-1 --wait
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
	"github.com/idemsaga/idemsaga/examples/order"
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
	StepTimeout time.Duration `name:"step-timeout" env:"IDEMSAGA_STEP_TIMEOUT" default:"30s" help:"Timeout of one attempt of a step of the examples."`
	MaxAttempts int           `name:"max-attempts" env:"IDEMSAGA_MAX_ATTEMPTS" default:"5" help:"Attempts of a step of the examples, the first included."`
	MaxBackoff  time.Duration `name:"max-backoff" env:"IDEMSAGA_MAX_BACKOFF" default:"30s" help:"Longest wait between two attempts of a step of the examples."`
	PaymentsURL string        `name:"payments-url" env:"IDEMSAGA_PAYMENTS_URL" default:"http://127.0.0.1:9465" help:"Base URL of the payment service the order example charges (worker payments runs one)."`
	LeaseGrace  time.Duration `name:"lease-grace" env:"IDEMSAGA_LEASE_GRACE" default:"30s" help:"Added to a step's timeout to make its lease."`
	LogLevel    string        `name:"log-level" env:"LOG_LEVEL" default:"info" enum:"debug,info,warn,error" help:"Log level (debug, info, warn, error)."`
	LogFormat   string        `name:"log-format" env:"LOG_FORMAT" default:"text" enum:"text,json" help:"Log format (text or json)."`
}

type cli struct {
	globals

	Migrate   migrateCmd   `cmd:"" help:"Create or update the engine's tables and the examples' (transfer, order, payment service)."`
	Seed      seedCmd      `cmd:"" help:"Create the examples' accounts and products (after migrate), which reconcile checks money and stock against."`
	Run       runCmd       `cmd:"" help:"Run a worker: outbox relay, step workers, orchestrator and lease reaper, until SIGINT or SIGTERM."`
	Transfer  transferCmd  `cmd:"" help:"Start a money transfer saga (the same key gives the same saga)."`
	Order     orderCmd     `cmd:"" help:"Start an order saga: reserve stock, charge at the payment service, ship (the same key gives the same saga)."`
	Payments  paymentsCmd  `cmd:"" help:"Run the order example's payment service, optionally misbehaving (lost answers, 500s, slow answers)."`
	List      listCmd      `cmd:"" help:"List sagas, newest first, filtered by definition, state, age or stuckness."`
	Show      showCmd      `cmd:"" aliases:"status" help:"Show a saga by ID or idempotency key, with every step attempt."`
	Retry     retryCmd     `cmd:"" help:"Resume a failed saga's compensation, or run a parked saga's step again (same step keys: nothing runs twice)."`
	Cancel    cancelCmd    `cmd:"" help:"Stop a running saga, or a parked one, and compensate what it completed."`
	Reconcile reconcileCmd `cmd:"" help:"Check the engine's and the examples' invariants; print each difference and exit non-zero when any is found."`
	Demo      demoCmd      `cmd:"" help:"Run the transfer demo on embedded defaults: an in-process NATS server and a fresh demo database."`
	Chaos     chaosCmd     `cmd:"" help:"Run transfers or orders across worker processes while killing, pausing and disconnecting them and restarting NATS; then reconcile."`
	Bench     benchCmd     `cmd:"" help:"Measure transfer sagas per second, latency and cost per saga against the local PostgreSQL, with pgbench as the ceiling."`
}

// examples returns the examples' sagas, transfer and order, with the
// configured policy.
func (g *globals) examples() (transferDef, orderDef *saga.Definition, err error) {
	if g.StepTimeout <= 0 || g.MaxAttempts < 1 || g.LeaseGrace <= 0 || g.MaxBackoff < saga.InitialBackoffDefault {
		return nil, nil, fmt.Errorf("--step-timeout and --lease-grace must be positive, --max-attempts at least 1 and --max-backoff at least %s", saga.InitialBackoffDefault)
	}
	policy := saga.RetryPolicy{Timeout: g.StepTimeout, MaxAttempts: g.MaxAttempts, MaxBackoff: g.MaxBackoff}
	if transferDef, err = transfer.NewDefinition(policy); err != nil {
		return nil, nil, err
	}
	orderDef, err = order.NewDefinition(order.Config{PaymentsURL: g.PaymentsURL, Policy: policy})
	return transferDef, orderDef, err
}

// definitions returns every saga the worker runs.
func (g *globals) definitions() ([]*saga.Definition, error) {
	t, o, err := g.examples()
	if err != nil {
		return nil, err
	}
	return []*saga.Definition{t, o}, nil
}

// client returns a saga client configured like the workers, and the
// definition of the named example.
func (g *globals) client(pool *pgxpool.Pool, name string) (*engine.Client, *saga.Definition, error) {
	defs, err := g.definitions()
	if err != nil {
		return nil, nil, err
	}
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: defs, SubjectPrefix: g.SubjectPrefix, LeaseGrace: g.LeaseGrace})
	if err != nil {
		return nil, nil, err
	}
	for _, d := range defs {
		if d.Name() == name {
			return cl, d, nil
		}
	}
	return cl, nil, nil
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
