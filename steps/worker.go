package steps

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

// ConcurrencyDefault is the number of commands a worker handles at once.
const ConcurrencyDefault = 8

// RecentDefault is how many answered attempts a worker remembers.
const RecentDefault = 16384

// Config configures a Worker.
type Config struct {
	// Pool is the engine's database: the inbox, the outbox, the sagas, and
	// the business tables of database steps. Required.
	Pool *pgxpool.Pool
	// NATS is a connection to the deployment's JetStream server. The
	// worker reads commands from the stream's durable consumer of each
	// of its definitions' commands, the ones engines read too, so engines
	// and step workers split the commands between them. Required by Start.
	NATS *nats.Conn
	// Stream is the deployment's stream. Defaults to the engine's
	// default, "IDEMSAGA".
	Stream string
	// Schema is the PostgreSQL schema of the deployment's tables (the
	// engines' Config.Schema). Defaults to "idemsaga".
	Schema string
	// SubjectPrefix is the deployment's subject prefix. Defaults to the
	// engine's default, "idemsaga".
	SubjectPrefix string
	// AckWait is how long JetStream waits for an ack before redelivering;
	// it must match the engines' (engine.Config.AckWait). Defaults to
	// 60s, or the longest step Timeout plus 30s when that is longer.
	AckWait time.Duration
	// Definitions the worker can run, each version it runs. A command of
	// another definition, version or step is handed back to the broker for
	// a worker that runs it and, after a bounded number of deliveries,
	// parked in the dead-letter table, which the engines of its version
	// send again (a stand-alone worker does not). Required.
	Definitions []*saga.Definition
	// Concurrency is the number of commands handled at once. Defaults to
	// ConcurrencyDefault.
	Concurrency int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the worker's metrics (the engine's step
	// metrics). Nil registers nothing.
	Registerer prometheus.Registerer
	// Recent is how many answered attempts (step key and attempt) the
	// worker remembers, so that another delivery of one is acknowledged
	// without a round trip to the database: a fast path in front of the
	// inbox, which stays the guarantee. Only outcomes the inbox holds are
	// remembered. Defaults to RecentDefault; -1 remembers nothing.
	Recent int
	// TracerProvider, if set, records a span for each attempt, a child of
	// the trace context in its command's headers, and writes that span's
	// context into the headers of its reply (engine.Config.TracerProvider
	// tells the rest). Defaults to none: no spans and no trace headers.
	TracerProvider trace.TracerProvider
}

// Worker consumes and runs step commands, and answers every outcome with a
// reply for the orchestrator, written to the outbox, which the engines'
// relays publish. An engine runs its own step workers, which apply
// outcomes to their saga in the step's transaction instead.
type Worker struct {
	cfg      Config
	subjects wire.Subjects
	metrics  *metrics.Metrics
	runner   *attempt.Runner
	schema   *pgschema.Schema
	life     lifecycle.Runner
}

// New returns a worker; Start runs it.
func New(cfg Config) (*Worker, error) {
	switch {
	case cfg.Pool == nil:
		return nil, errors.New("steps: Config.Pool is required")
	case len(cfg.Definitions) == 0:
		return nil, errors.New("steps: Config.Definitions is empty; give the worker the sagas it runs")
	case cfg.Concurrency < 0:
		return nil, fmt.Errorf("steps: Config.Concurrency is %d; use a positive number, or 0 for %d", cfg.Concurrency, ConcurrencyDefault)
	case cfg.Recent < -1:
		return nil, fmt.Errorf("steps: Config.Recent is %d; use a positive number, 0 for %d, or -1 to remember nothing", cfg.Recent, RecentDefault)
	}
	var longest time.Duration
	for i, d := range cfg.Definitions {
		if d == nil {
			return nil, fmt.Errorf("steps: Config.Definitions[%d] is nil", i)
		}
		if !d.Runnable() {
			return nil, fmt.Errorf("steps: Config.Definitions[%d] (%q) has no handlers; give the worker the definition built with saga.New", i, d.Name())
		}
		for _, st := range d.Steps() {
			longest = max(longest, st.Retry.Timeout, st.CompensateRetry.Timeout)
		}
	}
	if cfg.Stream == "" {
		cfg.Stream = streamDefault
	}
	if cfg.SubjectPrefix == "" {
		cfg.SubjectPrefix = subjectPrefixDefault
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = max(60*time.Second, longest+30*time.Second)
	}
	if cfg.Recent == 0 {
		cfg.Recent = RecentDefault
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = ConcurrencyDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := metrics.New(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("steps: %w", err)
	}
	subjects := wire.Subjects{Prefix: cfg.SubjectPrefix}
	schema, err := pgschema.New(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("steps: Config.Schema: %w", err)
	}
	r, err := attempt.New(attempt.Config{
		Pool: cfg.Pool, Schema: schema, Definitions: cfg.Definitions, Subjects: subjects, Logger: cfg.Logger, Metrics: m,
		Recent: max(cfg.Recent, 0), Slots: cfg.Concurrency,
		Tracer: tracing.New(cfg.TracerProvider),
	})
	if err != nil {
		return nil, fmt.Errorf("steps: %w", err)
	}
	return &Worker{cfg: cfg, subjects: subjects, metrics: m, runner: r, schema: schema}, nil
}

// Start checks the database and runs the worker in the background until
// Stop.
func (w *Worker) Start(ctx context.Context) error {
	if w.cfg.NATS == nil {
		return errors.New("steps: Config.NATS is required to start the worker: connect with nats.Connect(NATS_URL)")
	}
	if err := checkDatabase(ctx, w.cfg.Pool, w.cfg.Schema); err != nil {
		return err
	}
	js, err := jetstream.New(w.cfg.NATS)
	if err != nil {
		return fmt.Errorf("steps: JetStream: %w", err)
	}
	// One consumer per definition, the engines' own: a command reaches
	// a process that runs its definition.
	var names []string
	for _, d := range w.cfg.Definitions {
		names = append(names, d.Name())
	}
	var consumers []broker.ConsumerFunc
	for _, dc := range broker.DefinitionConsumers(w.cfg.Stream+"_steps", names, w.subjects.Commands) {
		consumers = append(consumers, func(ctx context.Context) (jetstream.Consumer, error) {
			s, err := broker.EnsureStream(ctx, js, broker.StreamConfig{Name: w.cfg.Stream, Owner: w.schema.Name(), Subjects: []string{w.subjects.All()}})
			if err != nil {
				return nil, fmt.Errorf("steps: %w (check NATS_URL and that nats-server runs with -js)", err)
			}
			return broker.EnsureDefinitionConsumer(ctx, s, broker.ConsumerConfig{
				Durable: dc.Durable, Filter: dc.Filter, AckWait: w.cfg.AckWait, MaxAckPending: 10000,
			}, w.cfg.Stream+"_steps", w.cfg.Logger)
		})
	}
	for _, c := range consumers {
		if _, err := c(ctx); err != nil {
			return err
		}
	}
	return w.life.Start(ctx, func(ctx context.Context) {
		// The runner's slots bound the commands of every definition
		// handled at once.
		broker.Pools(ctx, context.WithoutCancel(ctx), w.cfg.Logger, consumers, w.cfg.Concurrency, w.runner.HandleMsg)
	})
}

// checkDatabase fails when the database is unreachable or its schema is
// not this build's: every command would be refused and delivered again,
// forever.
func checkDatabase(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("step worker: database unreachable: %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.CheckSchema(ctx, conn.Conn(), schema); err != nil {
		return fmt.Errorf("step worker: %w", err)
	}
	return nil
}

// Stop finishes the commands in hand and returns. Calling it twice is fine.
func (w *Worker) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// HandleMsg runs one command message and acks it after commit.
func (w *Worker) HandleMsg(ctx context.Context, msg jetstream.Msg) { w.runner.HandleMsg(ctx, msg) }

// handle runs one command to a committed reply. It returns the reply: the
// one written, or, for a delivery of an attempt already answered, the
// stored outcome (Duplicate set), whose reply is already in the outbox. An
// error means nothing was committed and the command should be delivered
// again. redelivered reads the inbox before anything is claimed.
func (w *Worker) handle(ctx context.Context, cmd wire.Command, redelivered bool) (wire.Reply, error) {
	return w.runner.Handle(ctx, cmd, redelivered)
}

// The engine's defaults, which the worker must share with the engines of
// its deployment (package engine imports this one).
const (
	streamDefault        = "IDEMSAGA"
	subjectPrefixDefault = "idemsaga"
)
