// Package events starts the sagas of definitions with events
// (saga.WithEvents): a durable JetStream consumer per definition, on the
// stream that holds its subject, whose every message starts one saga
// under the message's key.
package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// ConcurrencyDefault is Config.Concurrency's default.
const ConcurrencyDefault = 4

// ErrRefused marks a start the Starter refuses for good (beside the
// saga package's refusals): the message goes to the dead letters.
var ErrRefused = errors.New("idemsaga: the event cannot start a saga")

// Starter starts a saga, as engine.Client.Start does; duplicate says the
// key named a saga with the same input already.
type Starter interface {
	Start(ctx context.Context, def *saga.Definition, key string, input any) (duplicate bool, err error)
}

// Config configures the consumers.
type Config struct {
	// Pool holds the engine's tables. Required.
	Pool *pgxpool.Pool
	// Schema is the deployment's schema; nil for the default.
	Schema *pgschema.Schema
	// JetStream reads the events. Required.
	JetStream jetstream.JetStream
	// Definitions are the process's. For each name the highest version
	// decides: its events, if it has any, start sagas of that version.
	Definitions []*saga.Definition
	// ConsumerPrefix begins each durable consumer's name, followed by
	// "_events_" and the definition's name. Required.
	ConsumerPrefix string
	// OwnSubjects is the engine's own subject prefix: events under it are
	// refused (they are the engine's commands and replies). Required.
	OwnSubjects string
	// AckWait is the consumers' ack wait. Required.
	AckWait time.Duration
	// Concurrency is how many messages of one definition are handled at
	// once. Defaults to ConcurrencyDefault.
	Concurrency int
	// Starter starts the sagas. Required.
	Starter Starter
	// Metrics counts the messages. Required.
	Metrics *metrics.Metrics
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Consumers runs one durable consumer per definition with events.
type Consumers struct {
	cfg    Config
	defs   []*saga.Definition
	runner lifecycle.Runner

	mu sync.Mutex
	// streams are the streams found for each definition.
	streams map[string]string
}

// New returns the consumers of cfg's definitions with events. It checks
// what it can without the broker: each subject is not the engine's own.
func New(cfg Config) (*Consumers, error) {
	if cfg.Pool == nil || cfg.JetStream == nil || cfg.Starter == nil || cfg.Metrics == nil {
		return nil, errors.New("idemsaga: events: Config.Pool, JetStream, Starter and Metrics are required")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = ConcurrencyDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	latest := map[string]*saga.Definition{}
	for _, d := range cfg.Definitions {
		if have, ok := latest[d.Name()]; !ok || d.Version() > have.Version() {
			latest[d.Name()] = d
		}
	}
	c := &Consumers{cfg: cfg, streams: map[string]string{}}
	for _, d := range latest {
		ev, ok := d.Events()
		if !ok {
			continue
		}
		first := strings.SplitN(ev.Subject, ".", 2)[0]
		own := strings.SplitN(cfg.OwnSubjects, ".", 2)[0]
		if first == own || first == "*" || first == ">" {
			return nil, fmt.Errorf("idemsaga: the events of %s: subject %q may take the engine's own messages (subject prefix %q); give a subject outside it", d.Ref(), ev.Subject, cfg.OwnSubjects)
		}
		c.defs = append(c.defs, d)
	}
	slices.SortFunc(c.defs, func(a, b *saga.Definition) int { return strings.Compare(a.Name(), b.Name()) })
	return c, nil
}

// Len returns how many definitions the consumers start sagas of.
func (c *Consumers) Len() int { return len(c.defs) }

// Check finds the stream of each definition's events and creates its
// durable consumer when missing: an engine fails at its start, not
// later, when no stream holds a subject.
func (c *Consumers) Check(ctx context.Context) error {
	for _, d := range c.defs {
		if _, err := c.consumer(ctx, d); err != nil {
			return err
		}
	}
	return nil
}

// Start runs the consumers until Stop; the messages in hand are handled
// under work, which outlives ctx. It returns at once.
func (c *Consumers) Start(ctx, work context.Context) error {
	if len(c.defs) == 0 {
		return nil
	}
	loops := make([]func(context.Context), len(c.defs))
	for i, d := range c.defs {
		loops[i] = func(ctx context.Context) {
			broker.Pool(ctx, work, c.cfg.Logger, func(ctx context.Context) (jetstream.Consumer, error) { return c.consumer(ctx, d) },
				c.cfg.Concurrency, func(ctx context.Context, msg jetstream.Msg) { c.Handle(ctx, d, msg) })
		}
	}
	return c.runner.Start(ctx, loops...)
}

// Stop stops fetching and lets the messages in hand finish.
func (c *Consumers) Stop(ctx context.Context) error { return c.runner.Stop(ctx) }

// ConsumerName is the durable consumer of definition's events.
func (c *Consumers) ConsumerName(definition string) string {
	return c.cfg.ConsumerPrefix + "_events_" + definition
}

// consumer returns d's durable consumer, creating it when missing, on the
// stream that holds its subject.
func (c *Consumers) consumer(ctx context.Context, d *saga.Definition) (jetstream.Consumer, error) {
	ev, _ := d.Events()
	name, err := c.stream(ctx, d.Name(), ev)
	if err != nil {
		return nil, err
	}
	s, err := c.cfg.JetStream.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("idemsaga: the events of %s: stream %q does not exist; create it to capture %q (nats stream add %s --subjects '%s'), or name the stream that does in saga.Events.Stream",
			d.Ref(), name, ev.Subject, name, ev.Subject)
	}
	if err != nil {
		return nil, fmt.Errorf("idemsaga: the events of %s: stream %q: %w", d.Ref(), name, err)
	}
	cons, err := broker.EnsureConsumer(ctx, s, broker.ConsumerConfig{
		Durable: c.ConsumerName(d.Name()), Filter: ev.Subject, AckWait: c.cfg.AckWait, MaxAckPending: 1000,
	})
	if err != nil {
		return nil, fmt.Errorf("idemsaga: the events of %s: %w (%s)", d.Ref(), err, broker.Hint(err))
	}
	return cons, nil
}

// stream returns the name of the stream of d's events: Events.Stream,
// or the one stream that captures its subject.
func (c *Consumers) stream(ctx context.Context, definition string, ev saga.Events) (string, error) {
	if ev.Stream != "" {
		return ev.Stream, nil
	}
	c.mu.Lock()
	name, ok := c.streams[definition]
	c.mu.Unlock()
	if ok {
		return name, nil
	}
	l := c.cfg.JetStream.StreamNames(ctx, jetstream.WithStreamListSubject(ev.Subject))
	var names []string
	for n := range l.Name() {
		names = append(names, n)
	}
	if err := l.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
		return "", fmt.Errorf("idemsaga: the events of %s: find the stream of subject %q: %w", definition, ev.Subject, err)
	}
	switch len(names) {
	case 0:
		return "", fmt.Errorf("idemsaga: the events of %s: no JetStream stream captures subject %q, so its messages would be lost; create one (nats stream add EVENTS --subjects '%s'), or name it in saga.Events.Stream",
			definition, ev.Subject, ev.Subject)
	case 1:
	default:
		slices.Sort(names)
		return "", fmt.Errorf("idemsaga: the events of %s: streams %s all capture subject %q; name the one to read in saga.Events.Stream", definition, strings.Join(names, ", "), ev.Subject)
	}
	c.mu.Lock()
	c.streams[definition] = names[0]
	c.mu.Unlock()
	return names[0], nil
}

// Handle starts the saga of one message of d's events, and acknowledges
// it once the start committed (or was there already). A message that
// cannot start a saga is parked in the event dead letters, with why, and
// acknowledged; one that met any other failure is delivered again later.
func (c *Consumers) Handle(ctx context.Context, d *saga.Definition, msg jetstream.Msg) {
	ev, _ := d.Events()
	name := d.Name()
	log := c.cfg.Logger.With("definition", d.Ref(), "subject", msg.Subject())
	delivered := 1
	if md, err := msg.Metadata(); err == nil {
		delivered = int(md.NumDelivered)
		log = log.With("stream", md.Stream, "stream_seq", md.Sequence.Stream)
	}
	key := msg.Headers().Get(ev.KeyHeader)
	if key == "" {
		c.park(ctx, log, d, msg, nil, delivered, fmt.Sprintf("the message has no %s header, which names its saga's key; publish it with one (jetstream.WithMsgID sets Nats-Msg-Id)", ev.KeyHeader))
		return
	}
	dup, err := c.cfg.Starter.Start(ctx, d, key, json.RawMessage(msg.Data()))
	switch {
	case errors.Is(err, saga.ErrInvalidKey), errors.Is(err, saga.ErrInvalidInput), errors.Is(err, saga.ErrIdempotencyKeyReused), errors.Is(err, ErrRefused):
		c.park(ctx, log, d, msg, &key, delivered, strings.TrimPrefix(err.Error(), "idemsaga: "))
	case err != nil:
		delay := min(time.Second<<min(delivered-1, 6), time.Minute)
		log.Warn("events: could not start the message's saga; it will be delivered again", "key", key, "delivery", delivered, "retry_in", delay, "error", err)
		_ = msg.NakWithDelay(delay)
	default:
		outcome := metrics.EventStarted
		if dup {
			outcome = metrics.EventDuplicate
		}
		c.cfg.Metrics.EventStarts.WithLabelValues(name, outcome).Inc()
		if err := msg.Ack(); err != nil {
			log.Debug("events: ack lost; the delivery again will find its saga", "key", key, "error", err)
		}
	}
}

// park records msg in the event dead letters with reason, then
// acknowledges it; a message it could not record is delivered again.
func (c *Consumers) park(ctx context.Context, log *slog.Logger, d *saga.Definition, msg jetstream.Msg, key *string, delivered int, reason string) {
	row := store.EventDeadLetter{Definition: d.Name(), Subject: msg.Subject(), Key: key, Headers: headersOf(msg), Payload: msg.Data(),
		Reason: reason, Deliveries: delivered, ParkedBy: parkedBy()}
	if row.Payload == nil {
		row.Payload = []byte{}
	}
	if md, err := msg.Metadata(); err == nil {
		row.Stream, row.StreamSeq = md.Stream, md.Sequence.Stream
	} else {
		log.Warn("events: a message without its stream's metadata; it will be delivered again", "error", err)
		_ = msg.NakWithDelay(time.Second)
		return
	}
	id, err := store.ParkEvent(ctx, c.cfg.Schema.Q(c.cfg.Pool), row)
	if err != nil {
		log.Warn("events: could not park a message that cannot start a saga; it will be delivered again", "reason", reason, "error", err)
		_ = msg.NakWithDelay(min(time.Second<<min(delivered-1, 6), time.Minute))
		return
	}
	c.cfg.Metrics.EventStarts.WithLabelValues(d.Name(), metrics.EventRefused).Inc()
	log.Warn("events: a message that cannot start a saga was parked in the event dead letters", "id", id, "reason", reason)
	_ = msg.Ack()
}

// headersOf returns msg's headers, each with its values joined.
func headersOf(msg jetstream.Msg) map[string]string {
	h := map[string]string{}
	for k, v := range msg.Headers() {
		h[k] = strings.Join(v, ", ")
	}
	return h
}

func parkedBy() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s pid %d", host, os.Getpid())
}
