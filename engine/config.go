package engine

import (
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
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
	// only grows, so clients are told to come back instead. The same bound
	// sheds starts while the queued messages are predicted to wait longer
	// than it at the pace the workers were measured to take them
	// (Engine.ShedStart). NoShedding (a negative value) sheds nothing by
	// age or predicted wait.
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
	schemaErr := pgschema.Check(c.Schema)
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
	case schemaErr != nil:
		return fmt.Errorf("idemsaga: Config.Schema: %w", schemaErr)
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
