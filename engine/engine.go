package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// Defaults of Config.
const (
	StreamDefault           = "IDEMSAGA"
	SubjectPrefixDefault    = "idemsaga"
	SchemaDefault           = pgschema.SchemaDefault
	StepConcurrencyDefault  = 8
	ReplyConcurrencyDefault = 4
	LeaseGraceDefault       = 30 * time.Second
	ReapIntervalDefault     = 100 * time.Millisecond
	ReapBatchDefault        = 100
	AckWaitDefault          = 60 * time.Second
	MaxInputBytesDefault    = 256 << 10
	MaxResultBytesDefault   = 256 << 10
)

// ReconcileIntervalDefault is Config.ReconcileInterval's default.
const ReconcileIntervalDefault = time.Minute

// NoReconcile, as Config.ReconcileInterval, runs no reconcile in the
// engine: the state_differences metric is then not exported.
const NoReconcile time.Duration = -1

// NoShedding, as Config.ShedOldestAge, sheds no start however old the
// stream's oldest message (with ShedStreamMessages 0, none at all).
const NoShedding time.Duration = -1

// Config configures an Engine. Only Pool, NATS and Definitions are required.
type Config struct {
	// Pool is the PostgreSQL database holding the engine's tables (in
	// Schema; apply migrations first). Required.
	Pool *pgxpool.Pool
	// Schema is the PostgreSQL schema of the deployment's tables: two
	// deployments (each with its own Stream and SubjectPrefix) share a
	// database in two schemas and never see each other's sagas. Apply
	// the migrations to it first (migrations.MigrateSchema, the runtime's
	// `migrate --schema`). It is recorded with the deployment's settings.
	// Defaults to SchemaDefault.
	Schema string
	// NATS is a connection to a server with JetStream enabled. Required by
	// New; NewClient does not need it.
	NATS *nats.Conn
	// Definitions are the sagas this engine runs. Every process sharing a
	// database must run the same description of a definition's version
	// (steps, kinds, policies): each checks its own against the
	// deployment's record at start. Several versions of one name
	// (saga.WithVersion) may be given; a saga runs the version it started
	// with to its end. Required by New; a client without them starts and
	// repairs sagas from the recorded descriptions (Client.Definition).
	Definitions []*saga.Definition
	// Stream is the JetStream stream name. Defaults to StreamDefault.
	Stream string
	// SubjectPrefix prefixes every subject of the stream. Defaults to
	// SubjectPrefixDefault.
	SubjectPrefix string
	// StreamReplicas is the stream's replica count, 1 to 5: with a
	// JetStream cluster, 3 keeps sagas moving while a node is down. A new
	// stream gets it (Defaults to 1); an existing stream with another
	// count is updated to it, and the change logged. Zero leaves an
	// existing stream's count alone: the engine never lowers it.
	StreamReplicas int
	// StreamStorage is "file" or "memory". A new stream gets it (Defaults
	// to file); an existing stream with other storage is an error, since
	// JetStream cannot change it.
	StreamStorage string
	// StreamMaxAge, if set, is the stream's max age: messages older are
	// dropped (PostgreSQL drives a lost command again at its lease).
	// Applied as StreamReplicas is. Defaults to none.
	StreamMaxAge time.Duration
	// StreamDuplicateWindow is the stream's Nats-Msg-Id dedup window, a
	// fast path only. Applied as StreamReplicas is. Defaults to 2 minutes
	// for a new stream.
	StreamDuplicateWindow time.Duration
	// StepConcurrency is the number of step commands a process handles at
	// once. Defaults to StepConcurrencyDefault.
	StepConcurrency int
	// ReplyConcurrency is the number of replies a process applies at once.
	// Defaults to ReplyConcurrencyDefault.
	ReplyConcurrency int
	// LeaseGrace is added to a step's Timeout to make its lease: how long a
	// claimed attempt may go without a reply before it is dispatched
	// again. Time a command waits in the queue before a worker claims it
	// spends no attempt (the command keeps its attempt, and is sent again
	// only if the stream lost it). Defaults to LeaseGraceDefault.
	LeaseGrace time.Duration
	// ReapInterval is how often due retries and expired leases are looked
	// for. Defaults to ReapIntervalDefault.
	ReapInterval time.Duration
	// AckWait is how long JetStream waits for an ack before redelivering.
	// It must exceed every step's Timeout. Defaults to AckWaitDefault, or
	// the longest step Timeout plus 30s when that is longer.
	AckWait time.Duration
	// MaxInputBytes bounds a saga's input, in canonical JSON. Commands carry
	// the input and earlier results and must fit the broker's max payload
	// (1 MiB by default). Defaults to MaxInputBytesDefault.
	MaxInputBytes int
	// Codec, if set, seals the sagas' data at rest: inputs, step results
	// (in the tables, the outbox and the stream's messages) and callback
	// results are kept sealed, and opened where a handler, a condition or
	// a reader (Get, List, the HTTP API, show) needs them. Every process
	// of the deployment needs it (or a keyring that opens what it sealed);
	// one without it refuses to start a handler on sealed data, and says
	// so. Data kept before a Codec was set is read as it is. NewAESGCM is
	// one. Defaults to none: data is kept as given.
	Codec saga.Codec
	// MaxResultBytes bounds a step's result, in canonical JSON, and a
	// skip's or a callback's: commands carry the results of the steps
	// before theirs, and the saga's row keeps them all. A handler's result
	// over it fails the attempt, with an error saying so: a database
	// step's transaction is rolled back (it failed for good, with no
	// effect), an external step's call may have taken effect (its attempt
	// counts as unknown: tried again under its key, and compensated if it
	// never fits). A skip or callback over it is refused
	// (ErrResultTooLarge) and nothing is written. Defaults to
	// MaxResultBytesDefault.
	MaxResultBytes int
	// RelayBatch is the outbox relay's batch size. Defaults to
	// outbox.BatchSizeDefault.
	RelayBatch int
	// RelayPollInterval is how often the relay looks for rows without a
	// wake-up. Defaults to outbox.PollIntervalDefault.
	RelayPollInterval time.Duration
	// RelayHandOff is how long the relay leaves an outbox row to the
	// process that committed it: that process publishes the row itself
	// right after the commit, and deletes it once the broker acknowledged
	// it. Past the hand-off the relay publishes whatever is still there (a
	// crash between a commit and its publish, a publish the broker did not
	// acknowledge). Defaults to outbox.HandOffDefault.
	RelayHandOff time.Duration
	// Retention sets how long finished sagas, inbox rows and published
	// outbox rows are kept; each engine runs a cleaner with it. Zero
	// fields take the defaults (7 days of replay for sagas and the inbox).
	// With FinishedSagas KeepForever and PublishedOutbox 0 or KeepForever
	// there is nothing to delete, and no cleaner runs (expired submit
	// tokens stay too).
	Retention RetentionConfig
	// OnFinishedFunc, if set, is called after the commit that brings a saga
	// to a terminal state in this process (not in other processes, nor for
	// a …Tx repair, whose commit is the caller's). It must be quick; it
	// runs on the engine's goroutines.
	OnFinishedFunc func(id uuid.UUID, definition string, state saga.State)
	// ShedOldestAge makes Engine.ShedStart refuse saga starts (the HTTP
	// API answers 503 and writes nothing) while the oldest message in the
	// stream has waited longer than it. Defaults to LeaseGrace, the time a
	// command is meant to wait in the queue at most: past it every new
	// saga waits longer than the deployment was sized for and the backlog
	// only grows, so clients are told to come back instead. NoShedding (a
	// negative value) sheds nothing by age.
	ShedOldestAge time.Duration
	// ShedStreamMessages, if positive, also sheds starts while more
	// messages than it wait in the stream. Defaults to 0: no bound on the
	// count, whose meaning depends on the throughput (the age's does not).
	ShedStreamMessages int
	// ReconcileInterval is how often the engine runs Reconcile and sets
	// the idemsaga_state_differences gauge, by check, from what it found,
	// so that an alert fires on a difference without anyone running the
	// command. Each engine with a Registerer runs it, with the
	// definitions it knows. Defaults to ReconcileIntervalDefault;
	// NoReconcile runs none.
	ReconcileInterval time.Duration
	// ScheduleInterval is how often the engine looks for the due ticks of
	// its definitions' schedules (saga.WithSchedule), on the database's
	// clock. Defaults to ScheduleIntervalDefault.
	ScheduleInterval time.Duration
	// EventConcurrency is how many messages of one definition's events
	// (saga.WithEvents) a process handles at once. Defaults to
	// EventConcurrencyDefault.
	EventConcurrency int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the engine's metrics. Nil registers nothing.
	Registerer prometheus.Registerer
	// TracerProvider, if set, traces sagas with OpenTelemetry: spans for
	// each start, step attempt, compensation attempt, reply applied,
	// reaper take-over and relay publish, all of one saga in one trace,
	// whose W3C context travels in the outbox rows, the NATS headers and
	// the saga's row. Defaults to none: no spans and no trace headers.
	TracerProvider trace.TracerProvider

	// deadLetters bounds the deliveries of a command this engine's step
	// workers cannot run before they park it; the tests shorten it.
	deadLetters attempt.DeadLetterPolicy
}

var streamName = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
var subjectToken = regexp.MustCompile(`^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$`)

// WithDefaults returns a copy of c with its zero fields set to their
// defaults (the engine applies them itself; this shows what it runs with).
func (c *Config) WithDefaults() *Config {
	d := *c
	if d.RelayHandOff == 0 {
		d.RelayHandOff = outbox.HandOffDefault
	}
	if d.Stream == "" {
		d.Stream = StreamDefault
	}
	if d.SubjectPrefix == "" {
		d.SubjectPrefix = SubjectPrefixDefault
	}
	if d.Schema == "" {
		d.Schema = SchemaDefault
	}
	if d.StepConcurrency == 0 {
		d.StepConcurrency = StepConcurrencyDefault
	}
	if d.ReplyConcurrency == 0 {
		d.ReplyConcurrency = ReplyConcurrencyDefault
	}
	if d.LeaseGrace == 0 {
		d.LeaseGrace = LeaseGraceDefault
	}
	if d.ReconcileInterval == 0 {
		d.ReconcileInterval = ReconcileIntervalDefault
	}
	if d.ReapInterval == 0 {
		d.ReapInterval = ReapIntervalDefault
	}
	if d.ShedOldestAge == 0 {
		d.ShedOldestAge = d.LeaseGrace
	}
	if d.MaxInputBytes == 0 {
		d.MaxInputBytes = MaxInputBytesDefault
	}
	if d.MaxResultBytes == 0 {
		d.MaxResultBytes = MaxResultBytesDefault
	}
	if d.Logger == nil {
		d.Logger = slog.Default()
	}
	// The broker must not redeliver a command while its handler may still
	// be running: the copy would wait on the first's inbox row, holding a
	// handler slot and a connection.
	if d.AckWait == 0 {
		d.AckWait = max(AckWaitDefault, longestTimeout(d.Definitions)+30*time.Second)
	}
	d.Retention = d.Retention.WithDefaults()
	return &d
}

// longestTimeout is the longest step or compensation timeout of defs.
func longestTimeout(defs []*saga.Definition) time.Duration {
	var longest time.Duration
	for _, d := range defs {
		if d == nil {
			continue
		}
		for _, st := range d.Steps() {
			longest = max(longest, st.Retry.Timeout)
			if st.Compensate != nil {
				longest = max(longest, st.CompensateRetry.Timeout)
			}
		}
	}
	return longest
}

// validate checks c, defaults applied (WithDefaults); needNATS for an
// engine, which runs steps.
func (c *Config) validate(needNATS bool) error {
	switch {
	case c.Pool == nil:
		return errors.New("idemsaga: Config.Pool is required: open one with pgxpool.New(ctx, DATABASE_URL)")
	case needNATS && c.NATS == nil:
		return errors.New("idemsaga: Config.NATS is required: connect with nats.Connect(NATS_URL)")
	case needNATS && len(c.Definitions) == 0:
		return errors.New("idemsaga: Config.Definitions is empty: give the engine the sagas it runs")
	case c.StepConcurrency < 0, c.ReplyConcurrency < 0, c.RelayBatch < 0:
		return errors.New("idemsaga: Config.StepConcurrency, ReplyConcurrency and RelayBatch must not be negative")
	case c.LeaseGrace < 0, c.ReapInterval < 0, c.AckWait < 0, c.RelayPollInterval < 0, c.RelayHandOff < 0:
		return errors.New("idemsaga: Config.LeaseGrace, ReapInterval, AckWait, RelayPollInterval and RelayHandOff must not be negative")
	case c.StreamReplicas < 0 || c.StreamReplicas > 5:
		return fmt.Errorf("idemsaga: Config.StreamReplicas %d must be 1 to 5 (JetStream's limit), or 0 to leave an existing stream's count", c.StreamReplicas)
	case c.StreamStorage != "" && c.StreamStorage != "file" && c.StreamStorage != "memory":
		return fmt.Errorf("idemsaga: Config.StreamStorage %q must be \"file\" or \"memory\"", c.StreamStorage)
	case c.StreamMaxAge < 0 || c.StreamDuplicateWindow < 0:
		return errors.New("idemsaga: Config.StreamMaxAge and StreamDuplicateWindow must not be negative")
	case c.StreamMaxAge > 0 && c.StreamDuplicateWindow > c.StreamMaxAge:
		return fmt.Errorf("idemsaga: Config.StreamDuplicateWindow (--stream-duplicate-window) %s must not exceed StreamMaxAge (--stream-max-age) %s: JetStream refuses it; give a shorter window or a longer max age", c.StreamDuplicateWindow, c.StreamMaxAge)
	case pgschema.Check(c.Schema) != nil:
		return fmt.Errorf("idemsaga: Config.Schema: %w", pgschema.Check(c.Schema))
	case !streamName.MatchString(c.Stream):
		return fmt.Errorf("idemsaga: Config.Stream %q must be letters, digits, '_' or '-'", c.Stream)
	case !subjectToken.MatchString(c.SubjectPrefix):
		return fmt.Errorf("idemsaga: Config.SubjectPrefix %q must be dot-separated tokens of letters, digits, '_' or '-'", c.SubjectPrefix)
	case c.ShedOldestAge < 0 && c.ShedOldestAge != NoShedding:
		return fmt.Errorf("idemsaga: Config.ShedOldestAge is %s; use a positive duration, 0 for the lease grace, or NoShedding", c.ShedOldestAge)
	case c.ShedStreamMessages < 0:
		return errors.New("idemsaga: Config.ShedStreamMessages must not be negative; 0 puts no bound on the count")
	case c.ReconcileInterval < 0 && c.ReconcileInterval != NoReconcile:
		return fmt.Errorf("idemsaga: Config.ReconcileInterval is %s; use a positive duration, 0 for %s, or NoReconcile", c.ReconcileInterval, ReconcileIntervalDefault)
	case c.MaxInputBytes < 0 || c.MaxResultBytes < 0:
		return errors.New("idemsaga: Config.MaxInputBytes and MaxResultBytes must not be negative; leave them 0 for the defaults")
	}
	seen := map[string]bool{}
	for _, d := range c.Definitions {
		if d == nil {
			return errors.New("idemsaga: Config.Definitions holds a nil definition")
		}
		if needNATS && !d.Runnable() {
			return fmt.Errorf("idemsaga: Config.Definitions: %q has no handlers (it was rebuilt from a description); an engine runs steps, so give it the definition built with saga.New", d.Name())
		}
		if seen[d.Ref()] {
			return fmt.Errorf("idemsaga: Config.Definitions names %s twice; give each version of a definition once (saga.WithVersion)", d.Ref())
		}
		seen[d.Ref()] = true
	}
	if longest := longestTimeout(c.Definitions); c.AckWait <= longest {
		return fmt.Errorf("idemsaga: Config.AckWait (%s) must exceed the longest step Timeout (%s); raise it or leave it 0 for a fitting default", c.AckWait, longest)
	}
	return c.Retention.validate()
}

// schema is Config.Schema's, once validated.
func (c *Config) schema() *pgschema.Schema {
	s, err := pgschema.New(c.Schema)
	if err != nil {
		panic("idemsaga: Config.Schema used before it was validated: " + err.Error())
	}
	return s
}

func newCore(cfg *Config, out orchestrate.HandOff) (*orchestrate.Core, error) {
	m, err := metrics.New(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return newCoreWith(cfg, m, out), nil
}

// newCoreWith is newCore with the metrics already registered.
func newCoreWith(cfg *Config, m *metrics.Metrics, out orchestrate.HandOff) *orchestrate.Core {
	return orchestrate.New(orchestrate.Config{
		Pool: cfg.Pool, Schema: cfg.schema(), Sealer: seal.New(cfg.Codec), Definitions: cfg.Definitions, SubjectPrefix: cfg.SubjectPrefix, LeaseGrace: cfg.LeaseGrace,
		MaxInputBytes: cfg.MaxInputBytes, MaxResultBytes: cfg.MaxResultBytes, Metrics: m, Logger: cfg.Logger, Tracer: tracing.New(cfg.TracerProvider),
		HandOff: out, OnFinished: cfg.OnFinishedFunc,
	})
}

// NewClient returns a client that starts and reads sagas without running
// any worker. It uses Pool, Definitions, SubjectPrefix, LeaseGrace and
// Registerer of cfg.
func NewClient(cfg Config) (*Client, error) {
	cfg = *cfg.WithDefaults()
	if err := cfg.withChildren(); err != nil {
		return nil, err
	}
	if err := cfg.validate(false); err != nil {
		return nil, err
	}
	c, err := newCore(&cfg, nil)
	if err != nil {
		return nil, err
	}
	return &Client{c: c, cfg: cfg}, nil
}

// Engine is one worker process's share of the work: the outbox relay, the
// step workers, the orchestrator and the reaper of due retries and expired
// leases. Any number of engines may share one database and one stream.
type Engine struct {
	// id names this engine in idemsaga.workers.
	id       uuid.UUID
	cfg      Config
	c        *orchestrate.Core
	client   *Client
	js       jetstream.JetStream
	backlog  *maintenance.StreamBacklog
	subjects wire.Subjects
	relay    *outbox.Relay
	steps    *attempt.Runner
	cleaner  *maintenance.Cleaner
	// loseChildEnds drops the ends of children instead of telling their
	// parents (testhook.Hooks.LoseChildEnds).
	loseChildEnds atomic.Bool
	// stepRunner runs the step workers, runner the orchestrator and the
	// reaper: Stop drains the steps first.
	stepRunner lifecycle.Runner
	runner     lifecycle.Runner
	// trig starts the sagas of schedules and events.
	trig triggers

	// dup runs the copies of commands the test kit delivers (dups),
	// dupsInHand how many of them run.
	dup        *attempt.Runner
	dups       sync.WaitGroup
	dupsInHand atomic.Int64

	mu sync.Mutex
	// run is the current run (Start to the end of its stop), nil while
	// the engine is stopped.
	run *run
	// stopped is closed once the last run has stopped (Stopped).
	stopped chan struct{}
}

// run is one run of an engine, from Start to the end of its stop.
type run struct {
	// cancelWork cancels the work in hand (StopAndCancel, or the end of
	// Start's context).
	cancelWork context.CancelFunc
	// unwatch stops watching Start's context.
	unwatch func() bool
	// stopOnce begins the stop once; done is closed when it ended.
	stopOnce sync.Once
	done     chan struct{}
	// err is what the stop's parts reported, set before done closes.
	err error
}

// closedChan is what Stopped returns for an engine that never ran.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// New returns an engine; Start runs it.
func New(cfg Config) (*Engine, error) {
	cfg = *cfg.WithDefaults()
	if err := cfg.withChildren(); err != nil {
		return nil, err
	}
	if err := cfg.validate(true); err != nil {
		return nil, err
	}
	e := &Engine{id: uuid.New(), cfg: cfg, subjects: wire.Subjects{Prefix: cfg.SubjectPrefix}}
	var err error
	e.js, err = jetstream.New(cfg.NATS,
		jetstream.WithPublishAsyncMaxPending(4096),
		jetstream.WithPublishAsyncTimeout(outbox.PublishTimeoutDefault))
	if err != nil {
		return nil, fmt.Errorf("idemsaga: JetStream: %w", err)
	}
	var consumers []string
	for _, base := range []string{commandsConsumer, repliesConsumer} {
		for _, c := range broker.DefinitionConsumers(cfg.Stream+base, e.definitionNames(), func(string) string { return "" }) {
			consumers = append(consumers, c.Durable)
		}
	}
	e.backlog = maintenance.NewStreamBacklog(e.js, cfg.Stream, consumers...)
	m, err := metrics.New(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	e.relay, err = outbox.NewRelay(outbox.RelayConfig{
		Pool: cfg.Pool, Schema: cfg.Schema, JetStream: e.js, BatchSize: cfg.RelayBatch, PollInterval: cfg.RelayPollInterval,
		KeepPublished: cfg.Retention.PublishedOutbox != 0, Logger: cfg.Logger,
		OnPublishFunc: func(rows, dups int, took time.Duration) {
			m.OutboxPublished.Add(float64(rows))
			m.Deliveries.WithLabelValues(metrics.LayerBroker).Add(float64(rows))
			m.Duplicates.WithLabelValues(metrics.LayerBroker).Add(float64(dups))
			m.RelayBatchSeconds.Observe(took.Seconds())
		},
		RecoverFunc:    func(ctx context.Context) error { _, err := e.stream(ctx); return err },
		TracerProvider: cfg.TracerProvider,
	})
	if err != nil {
		return nil, err
	}
	// What this process commits it runs or publishes itself, right after
	// the commit; the relay sweeps only what that missed.
	out := &engineHandOff{relay: e.relay, after: cfg.RelayHandOff, backlog: e.backlog}
	c := newCoreWith(&cfg, m, out)
	e.c, e.client = c, &Client{c: c, cfg: cfg}
	if err := e.newTriggers(m); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		for _, col := range []struct {
			what string
			c    prometheus.Collector
		}{
			{"the outbox backlog", maintenance.NewBacklogCollector(cfg.Pool, c.Schema())},
			{"the paused sagas", maintenance.NewPausedCollector(cfg.Pool, c.Schema())},
			{"the dead-letter", maintenance.NewDeadLetterCollector(cfg.Pool, c.Schema())},
			{"the stream backlog", maintenance.NewStreamCollector(e.js, cfg.Stream, e.backlog)},
		} {
			if err := cfg.Registerer.Register(col.c); err != nil {
				return nil, fmt.Errorf("idemsaga: register %s metric: %w", col.what, err)
			}
		}
	}
	if cfg.Retention.cleans() {
		e.cleaner = maintenance.NewCleaner(cfg.Pool, cfg.Retention.cleaner(e.client), cfg.Logger)
	}
	// The engine's own step workers share its database: an outcome moves
	// its saga on in the step's own transaction.
	acfg := attempt.Config{
		Pool: cfg.Pool, Schema: c.Schema(), Definitions: cfg.Definitions, Subjects: e.subjects, Logger: cfg.Logger, Metrics: m, MaxResultBytes: cfg.MaxResultBytes,
		Sealer:    c.Sealer(),
		Publisher: out, Recent: steps.RecentDefault, Mover: c, Eager: true, LeaseGrace: cfg.LeaseGrace,
		Slots: cfg.StepConcurrency, DeadLetters: cfg.deadLetters, Tracer: c.Tracer(),
		Children: children{cl: e.client},
	}
	e.steps, err = attempt.New(acfg)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: %w", err)
	}
	out.steps = e.steps
	return e, nil
}

// arm gives a run the test kit's hooks (package testhook), before its
// step workers start.
func (e *Engine) arm(h *testhook.Hooks) {
	e.loseChildEnds.Store(h != nil && h.LoseChildEnds)
	if h == nil {
		e.steps.Arm(nil)
		return
	}
	if h.Faults != nil && e.dup == nil {
		// A copy the kit delivers goes to a runner that shares no memory
		// with the first, as a delivery to another worker would.
		if dup, err := e.steps.Twin(); err == nil {
			e.dup = dup
		} else {
			e.cfg.Logger.Error("test kit: no runner for the copies DeliverTwice delivers; they run on the engine's own", "error", err)
			e.dup = e.steps
		}
	}
	if h.Faults != nil {
		h.Faults.Duplicate = func(cmd wire.Command) {
			e.dupsInHand.Add(1)
			e.dups.Go(func() {
				defer e.dupsInHand.Add(-1)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				_, _ = e.dup.Handle(ctx, cmd, false)
			})
		}
	}
	e.steps.Arm(h.Faults)
	h.InHand = func() int { return e.steps.InHand() + int(e.dupsInHand.Load()) }
}

// Client returns a client whose starts wake this engine's relay at once.
func (e *Engine) Client() *Client { return e.client }

// applyReply records one reply, as the orchestrator does for every reply
// it consumes.
func (e *Engine) applyReply(ctx context.Context, r wire.Reply) (orchestrate.Verdict, error) {
	return e.c.ApplyReply(ctx, r)
}

// handleCommand runs one step command as the engine's step workers do: an
// outcome moves the saga on in the step's own transaction when it can,
// anything else is answered with a reply in the outbox.
func (e *Engine) handleCommand(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return e.steps.Handle(ctx, cmd, false)
}

// reapOnce runs one pass of the reaper.
func (e *Engine) reapOnce(ctx context.Context) (int, error) {
	return e.c.ReapOnce(ctx, ReapBatchDefault)
}

// childLoop tells parents the ends of the children this process moved
// to their end, right after each commit (the reaper's sweep tells those
// it missed).
func (e *Engine) childLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-e.c.ChildEnds():
			if e.loseChildEnds.Load() {
				continue
			}
			if err := e.c.ChildEnded(context.WithoutCancel(ctx), id); err != nil {
				e.cfg.Logger.Warn("engine: could not tell a child's end to its parent; the reaper's sweep will", "saga_id", id, "error", err)
			}
		}
	}
}

// Start checks the database (reachable, migrated) and the broker, creates
// the stream and durable consumers if missing, and runs everything in the
// background until Stop, StopAndCancel, or the end of ctx (which stops as
// StopAndCancel does: pass context.WithoutCancel(ctx) to keep the engine
// running past it). It returns once the engine takes work. A stopped
// engine can be started again.
func (e *Engine) Start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.run != nil {
		return errors.New("idemsaga: engine already started (or still stopping): call Stop, and wait for Stopped, before starting it again")
	}
	if err := e.cfg.Pool.Ping(ctx); err != nil {
		return fmt.Errorf("idemsaga: database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	if err := checkMigrated(ctx, e.cfg.Pool, e.cfg.Schema); err != nil {
		return err
	}
	if err := checkDeployment(ctx, e.c, &e.cfg, true); err != nil {
		return err
	}
	e.client.markChecked()
	if e.cfg.NATS.Opts.MaxReconnect >= 0 {
		e.cfg.Logger.Warn("the NATS connection stops reconnecting after a while; connect with nats.MaxReconnects(-1) so the engine survives long broker outages",
			"max_reconnects", e.cfg.NATS.Opts.MaxReconnect)
	}
	// Fail fast when the broker cannot host the stream and consumers.
	replies, commands := e.replyConsumers(), e.commandConsumers()
	for _, c := range append(slices.Clip(replies), commands...) {
		if _, err := c(ctx); err != nil {
			return err
		}
	}
	// The work in hand (handlers, replies being applied) runs under work:
	// a graceful stop lets it finish, a hard one cancels it.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	r := &run{cancelWork: cancelWork, done: make(chan struct{})}
	e.run, e.stopped = r, make(chan struct{})
	fail := func(err error) error {
		e.mu.Unlock()
		_ = e.StopAndCancel(context.Background())
		e.mu.Lock()
		return err
	}
	e.arm(testhook.From(ctx))
	if err := e.relay.Start(work); err != nil {
		return fail(err)
	}
	if e.cleaner != nil {
		if err := e.cleaner.Start(work); err != nil {
			return fail(err)
		}
	}
	if err := e.stepRunner.Start(work, func(ctx context.Context) {
		// The runner's slots bound the commands of every definition
		// handled at once.
		broker.Pools(ctx, work, e.cfg.Logger, commands, e.cfg.StepConcurrency, e.steps.HandleMsg)
	}, func(ctx context.Context) {
		// Commands this process commits run here at once when a slot is
		// free, rather than through the broker.
		e.steps.Serve(ctx, work)
	}); err != nil {
		return fail(err)
	}
	// Starts that return after Start are run here from the first one.
	select {
	case <-e.steps.Serving():
	case <-ctx.Done():
		return fail(fmt.Errorf("idemsaga: start: %w", ctx.Err()))
	}
	// Recorded as a worker of its versions before Start returns; parked
	// commands of those versions go out again now.
	e.beat(ctx)
	if err := e.runner.Start(work,
		func(ctx context.Context) {
			// ReplyConcurrency bounds the replies of every definition
			// applied at once.
			slots := make(chan struct{}, e.cfg.ReplyConcurrency)
			broker.Pools(ctx, work, e.cfg.Logger, replies, e.cfg.ReplyConcurrency, func(ctx context.Context, msg jetstream.Msg) {
				slots <- struct{}{}
				defer func() { <-slots }()
				e.c.HandleReplyMsg(ctx, msg)
			})
		},
		e.reapLoop,
		e.childLoop,
		e.heartbeat,
		e.watchFailovers,
		e.reconcileLoop,
	); err != nil {
		return fail(err)
	}
	if err := e.startTriggers(ctx, work); err != nil {
		return fail(err)
	}
	r.unwatch = context.AfterFunc(ctx, func() {
		e.cfg.Logger.Info("engine: the context Start was given ended; stopping and cancelling the work in hand")
		_ = e.StopAndCancel(context.Background())
	})
	return nil
}

func (e *Engine) reapLoop(ctx context.Context) {
	t := time.NewTicker(e.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for {
			n, err := e.reapOnce(context.WithoutCancel(ctx))
			if err != nil {
				e.cfg.Logger.Warn("reaper: pass failed; will retry", "error", err)
			}
			if n < ReapBatchDefault || ctx.Err() != nil {
				break
			}
		}
	}
}

// Stop drains and stops: consumers stop fetching and finish the messages
// in hand, then the reaper stops, then the relay publishes what was
// committed and stops. If ctx ends first, Stop returns its error while the
// drain goes on (Stopped says when it ends; StopAndCancel cancels the work
// in hand). Calling Stop again, or on an engine not running, is fine.
func (e *Engine) Stop(ctx context.Context) error {
	return e.stop(ctx, false)
}

// StopAndCancel stops as Stop does, and first cancels the work in hand:
// the contexts of running handlers end, and each attempt records what it
// knows (an external call cut short is unknown, and runs again under its
// key). It still waits for the handlers to return; if ctx ends first, it
// returns its error while the stop goes on.
func (e *Engine) StopAndCancel(ctx context.Context) error {
	return e.stop(ctx, true)
}

// Stopped returns a channel closed once the engine has stopped: at once
// for an engine not running, or once the stop of the running one ended,
// whatever the contexts given to Stop.
func (e *Engine) Stopped() <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped == nil {
		return closedChan
	}
	return e.stopped
}

func (e *Engine) stop(ctx context.Context, cancel bool) error {
	e.mu.Lock()
	r := e.run
	e.mu.Unlock()
	if r == nil {
		return nil
	}
	if cancel {
		r.cancelWork()
	}
	r.stopOnce.Do(func() { go e.stopRun(r) })
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("idemsaga: stop did not finish in time; the engine goes on draining (Stopped says when it ends; StopAndCancel cancels the work in hand): %w", ctx.Err())
	}
}

// stopRun stops run r to its end, then marks the engine stopped.
func (e *Engine) stopRun(r *run) {
	if r.unwatch != nil {
		r.unwatch()
	}
	ctx := context.Background()
	errs := e.stopTriggers(ctx)
	if e.cleaner != nil {
		errs = append(errs, e.cleaner.Stop(ctx))
	}
	e.steps.Drain()
	errs = append(errs, e.stepRunner.Stop(ctx))
	errs = append(errs, e.runner.Stop(ctx))
	if e.relay.Running() {
		if _, err := e.relay.RelayOnce(ctx); err != nil {
			e.cfg.Logger.Warn("relay: final flush failed; rows stay in the outbox for the next relay", "error", err)
		}
	}
	e.dups.Wait()
	errs = append(errs, e.relay.Stop(ctx))
	r.cancelWork()
	// Each part that failed alike says so once.
	seen := map[string]bool{}
	var distinct []error
	for _, err := range errs {
		if err != nil && !seen[err.Error()] {
			seen[err.Error()] = true
			distinct = append(distinct, err)
		}
	}
	r.err = errors.Join(distinct...)
	e.mu.Lock()
	e.run = nil
	close(e.stopped)
	e.mu.Unlock()
	close(r.done)
}

// checkMigrated fails when the database's schema is not this build's.
func checkMigrated(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: database unreachable: %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.CheckSchema(ctx, conn.Conn(), schema); err != nil {
		return fmt.Errorf("idemsaga: %w", err)
	}
	return nil
}
