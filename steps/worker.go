package steps

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/outbox"
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
	// Consumer returns the consumer of commands, creating it again when the
	// server lost it. Required by Start; Handle works without.
	Consumer broker.ConsumerFunc
	// Subjects names reply subjects. Required.
	Subjects wire.Subjects
	// Definitions the worker can run. Required.
	Definitions []*saga.Definition
	// Concurrency is the number of commands handled at once. Defaults to
	// ConcurrencyDefault.
	Concurrency int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, if set, is updated.
	Metrics *metrics.Metrics
	// CommittedFunc, if set, is called after each commit that wrote to the
	// outbox, to wake a relay. It is not called when PublishFunc is set.
	CommittedFunc func()
	// PublishFunc, if set, publishes each reply right after its commit
	// (outbox.Relay.Publish); the relay's sweep takes a reply over only
	// after HandOff. Without it replies are the relay's to publish at once.
	PublishFunc func(rows ...outbox.Committed)
	// HandOff is how long the relay leaves a reply to PublishFunc.
	// Defaults to outbox.HandOffDefault.
	HandOff time.Duration
	// Recent is how many answered attempts (step key and attempt) the
	// worker remembers, so that another delivery of one is acknowledged
	// without a round trip to the database: a fast path in front of the
	// inbox, which stays the guarantee. Only outcomes the inbox holds are
	// remembered. Defaults to RecentDefault; -1 remembers nothing.
	Recent int
}

// Worker consumes and runs step commands, and answers every outcome with a
// reply for the orchestrator. An engine runs its own step workers, which
// apply outcomes to their saga in the step's transaction instead.
type Worker struct {
	cfg    Config
	runner *attempt.Runner
	life   lifecycle.Runner
}

// New returns a worker; Start runs it.
func New(cfg Config) (*Worker, error) {
	switch {
	case cfg.Pool == nil:
		return nil, errors.New("steps: Config.Pool is required")
	case cfg.Subjects.Prefix == "":
		return nil, errors.New("steps: Config.Subjects is required")
	case len(cfg.Definitions) == 0:
		return nil, errors.New("steps: Config.Definitions is empty; give the worker the sagas it runs")
	case cfg.Concurrency < 0:
		return nil, fmt.Errorf("steps: Config.Concurrency is %d; use a positive number, or 0 for %d", cfg.Concurrency, ConcurrencyDefault)
	case cfg.HandOff < 0:
		return nil, fmt.Errorf("steps: Config.HandOff is %s; use a positive duration, or 0 for %s", cfg.HandOff, outbox.HandOffDefault)
	case cfg.Recent < -1:
		return nil, fmt.Errorf("steps: Config.Recent is %d; use a positive number, 0 for %d, or -1 to remember nothing", cfg.Recent, RecentDefault)
	}
	for i, d := range cfg.Definitions {
		if d == nil {
			return nil, fmt.Errorf("steps: Config.Definitions[%d] is nil", i)
		}
	}
	if cfg.Recent == 0 {
		cfg.Recent = RecentDefault
	}
	if cfg.HandOff == 0 {
		cfg.HandOff = outbox.HandOffDefault
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = ConcurrencyDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics, _ = metrics.New(nil)
	}
	r, err := attempt.New(attempt.Config{
		Pool: cfg.Pool, Definitions: cfg.Definitions, Subjects: cfg.Subjects, Logger: cfg.Logger, Metrics: cfg.Metrics,
		Publish: cfg.PublishFunc, HandOff: cfg.HandOff, Committed: cfg.CommittedFunc, Recent: max(cfg.Recent, 0),
	})
	if err != nil {
		return nil, fmt.Errorf("steps: %w", err)
	}
	return &Worker{cfg: cfg, runner: r}, nil
}

// Start checks the database and runs the worker in the background until
// Stop.
func (w *Worker) Start(ctx context.Context) error {
	if w.cfg.Consumer == nil {
		return errors.New("steps: Config.Consumer is required to start the worker")
	}
	if err := CheckDatabase(ctx, w.cfg.Pool); err != nil {
		return err
	}
	return w.life.Start(ctx, func(ctx context.Context) {
		broker.Pool(ctx, w.cfg.Logger, w.cfg.Consumer, w.cfg.Concurrency, w.runner.HandleMsg)
	})
}

// CheckDatabase fails when the database is unreachable or its schema is
// not this build's: every command would be refused and delivered again,
// forever.
func CheckDatabase(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("step worker: database unreachable: %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.Check(ctx, conn.Conn()); err != nil {
		return fmt.Errorf("step worker: %w", err)
	}
	return nil
}

// Stop finishes the commands in hand and returns. Calling it twice is fine.
func (w *Worker) Stop(ctx context.Context) error { return w.life.Stop(ctx) }

// HandleMsg runs one command message and acks it after commit.
func (w *Worker) HandleMsg(ctx context.Context, msg jetstream.Msg) { w.runner.HandleMsg(ctx, msg) }

// Handle runs one command to a committed reply. It returns the reply: the
// one written, or, for a delivery of an attempt already answered, the
// stored outcome (Duplicate set), whose reply is already in the outbox. An
// error means nothing was committed and the command should be delivered
// again.
func (w *Worker) Handle(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.runner.Handle(ctx, cmd, false)
}

// HandleRedelivered is Handle for a command the transport delivered before
// (JetStream's NumDelivered above 1; HandleMsg tells them apart by
// itself): the inbox is read before anything is claimed, and a duplicate
// is answered by that plain read.
func (w *Worker) HandleRedelivered(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.runner.Handle(ctx, cmd, true)
}
