package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/tracing"
)

// Defaults of RelayConfig.
const (
	BatchSizeDefault      = 256
	PollIntervalDefault   = 100 * time.Millisecond
	PublishTimeoutDefault = 5 * time.Second
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Pool is the database holding the outbox. Required.
	Pool *pgxpool.Pool
	// Schema is the PostgreSQL schema of the outbox (the deployment's,
	// engine.Config.Schema). Defaults to idemsaga.
	Schema string
	// JetStream publishes the rows. Required.
	JetStream jetstream.JetStream
	// BatchSize is the most rows claimed and published per transaction.
	// Defaults to BatchSizeDefault.
	BatchSize int
	// PollInterval is how often the relay looks for rows when nobody
	// called Notify. Defaults to PollIntervalDefault.
	PollInterval time.Duration
	// PublishTimeout bounds the wait for the broker's acks of one batch.
	// Defaults to PublishTimeoutDefault.
	PublishTimeout time.Duration
	// SettleInterval is how long rows acknowledged after Publish wait, at
	// most, to be deleted together (sooner once BatchSize are waiting).
	// Defaults to SettleIntervalDefault.
	SettleInterval time.Duration
	// KeepPublished marks a published row (published_at) instead of
	// deleting it, for whoever cleans the outbox later. By default the row
	// is deleted in the transaction that saw the broker's ack: no update,
	// no new index entry, nothing left to clean.
	KeepPublished bool
	// Logger receives errors. Defaults to slog.Default().
	Logger *slog.Logger
	// OnPublishFunc, if set, is called after each committed batch with the
	// number of rows marked published, how many of them the broker reported
	// as duplicates (dropped by its Nats-Msg-Id window), and how long
	// publishing took.
	OnPublishFunc func(rows, duplicates int, took time.Duration)
	// RecoverFunc, if set, is called when the broker answered that no
	// stream captures a subject (a server restarted without its storage,
	// say), to create the stream again before the next batch.
	RecoverFunc func(ctx context.Context) error
	// TracerProvider, if set, records a span (idemsaga.publish) for each
	// row published that carries a W3C trace context in its headers, and
	// publishes the row with that span's context in their place. Defaults
	// to none: no spans, and headers published as written.
	TracerProvider trace.TracerProvider
}

func (c *RelayConfig) validate() error {
	if c.Pool == nil {
		return errors.New("outbox: RelayConfig.Pool is required")
	}
	if err := pgschema.Check(c.Schema); err != nil {
		return fmt.Errorf("outbox: RelayConfig.Schema: %w", err)
	}
	if c.JetStream == nil {
		return errors.New("outbox: RelayConfig.JetStream is required")
	}
	if c.BatchSize < 0 || c.PollInterval < 0 || c.PublishTimeout < 0 || c.SettleInterval < 0 {
		return errors.New("outbox: RelayConfig.BatchSize, PollInterval, PublishTimeout and SettleInterval must not be negative")
	}
	if c.SettleInterval == 0 {
		c.SettleInterval = SettleIntervalDefault
	}
	if c.BatchSize == 0 {
		c.BatchSize = BatchSizeDefault
	}
	if c.PollInterval == 0 {
		c.PollInterval = PollIntervalDefault
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = PublishTimeoutDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Relay publishes committed outbox rows to JetStream. It sweeps the
// outbox for rows nobody publishes (RelayOnce, on a poll or a Notify), and
// settles rows their writer handed to Publish right after committing them.
type Relay struct {
	cfg     RelayConfig
	wake    chan struct{}
	handOff *handOff
	// schema is RelayConfig.Schema's.
	schema *pgschema.Schema
	runner lifecycle.Runner
	tracer *tracing.Tracer
}

// NewRelay returns a relay; Start runs it.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	schema, _ := pgschema.New(cfg.Schema)
	return &Relay{cfg: cfg, schema: schema, wake: make(chan struct{}, 1), handOff: newHandOff(), tracer: tracing.New(cfg.TracerProvider)}, nil
}

// Start checks the database and runs the relay in the background until Stop.
func (r *Relay) Start(ctx context.Context) error {
	if err := r.cfg.Pool.Ping(ctx); err != nil {
		return fmt.Errorf("outbox relay: database unreachable: %w", err)
	}
	return r.runner.Start(ctx, r.loop, r.settleLoop)
}

// Stop finishes the batch in hand, settles what Publish sent, and returns.
// Calling it twice is fine.
func (r *Relay) Stop(ctx context.Context) error { return r.runner.Stop(ctx) }

// Running reports whether the relay is started.
func (r *Relay) Running() bool { return r.runner.Running() }

// Notify hints that rows were committed, so the relay looks now instead of
// at its next poll. It never blocks.
func (r *Relay) Notify() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *Relay) loop(ctx context.Context) {
	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()
	for {
		n, err := r.RelayOnce(context.WithoutCancel(ctx))
		if err != nil {
			r.cfg.Logger.Warn("outbox relay: batch failed; will retry", "error", err)
		}
		if err == nil && n == r.cfg.BatchSize {
			if ctx.Err() != nil {
				return
			}
			continue // more may be waiting
		}
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-ticker.C:
		}
	}
}

type row struct {
	id      int64
	subject string
	msgID   string
	payload []byte
	headers map[string]string
}

// RelayOnce claims one batch, publishes it, and deletes (or marks, with
// KeepPublished) what the broker acknowledged. It returns the number of
// rows published.
//
// A batch costs three round trips to PostgreSQL: a look for rows to
// publish, then BEGIN with the claim, and COMMIT with the marks. A pass
// that finds nothing, as most do (the writers publish their rows
// themselves), costs the look alone.
func (r *Relay) RelayOnce(ctx context.Context) (int, error) {
	conn, err := r.cfg.Pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("acquire a connection: %w", err)
	}
	// A connection left inside a transaction (an error midway) is closed
	// by the pool on release rather than reused.
	defer conn.Release()
	var due bool
	if err := r.schema.Q(conn).QueryRow(ctx, anyDue).Scan(&due); err != nil {
		return 0, fmt.Errorf("look for rows to publish: %w", err)
	}
	if !due {
		return 0, nil
	}
	open := false
	defer func() {
		if open {
			_, _ = r.schema.Q(conn).Exec(context.WithoutCancel(ctx), "rollback")
		}
	}()

	var batch []row
	claim := &pgx.Batch{}
	claim.Queue("begin")
	claim.Queue(claimBatch, r.cfg.BatchSize).Query(func(rows pgx.Rows) error {
		var err error
		batch, err = pgx.CollectRows(rows, func(cr pgx.CollectableRow) (row, error) {
			var x row
			err := cr.Scan(&x.id, &x.subject, &x.msgID, &x.payload, &x.headers)
			return x, err
		})
		return err
	})
	open = true
	if err := r.schema.Q(conn).SendBatch(ctx, claim).Close(); err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	if len(batch) == 0 {
		open = false
		if _, err := r.schema.Q(conn).Exec(ctx, "commit"); err != nil {
			return 0, fmt.Errorf("commit: %w", err)
		}
		return 0, nil
	}

	start := time.Now()
	pubCtx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	futures := make([]jetstream.PubAckFuture, len(batch))
	failures := make([]error, len(batch))
	var spans []tracing.Span
	if r.tracer.Enabled() {
		spans = make([]tracing.Span, len(batch))
	}
	for i, x := range batch {
		msg := newMsg(x.subject, x.payload, x.headers)
		if spans != nil {
			spans[i] = r.tracer.StartPublish(msg, x.msgID, "sweep")
		}
		// A row the broker refuses must not hold back the rows after it:
		// record its error and go on.
		futures[i], failures[i] = r.cfg.JetStream.PublishMsgAsync(msg, jetstream.WithMsgID(x.msgID))
	}
	published := make([]int64, 0, len(batch))
	dups := 0
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case ack := <-f.Ok():
			published = append(published, batch[i].id)
			if ack != nil && ack.Duplicate {
				dups++
			}
		case err := <-f.Err():
			failures[i] = err
		case <-pubCtx.Done():
			failures[i] = fmt.Errorf("no ack from the broker within %s: %w", r.cfg.PublishTimeout, pubCtx.Err())
		}
	}
	for i, sp := range spans {
		outcome := "published"
		if failures[i] != nil {
			outcome = "failed"
		}
		sp.End(outcome, failures[i])
	}
	if err := failpoint.Inject(failpoint.RelayBeforeMark); err != nil {
		return 0, err // published, not marked: the next batch publishes again
	}
	var firstErr error
	failed, missingStream := 0, false
	marks := &pgx.Batch{}
	for i, err := range failures {
		if err == nil {
			continue
		}
		failed++
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
			missingStream = true
		}
		if firstErr == nil {
			firstErr = fmt.Errorf("publish outbox row %d to %s: %w", batch[i].id, batch[i].subject, err)
		}
		marks.Queue(markFailed, batch[i].id, err.Error())
	}
	if len(published) > 0 {
		if r.cfg.KeepPublished {
			marks.Queue(markPublished, published)
		} else {
			marks.Queue(deletePublished, published)
		}
	}
	marks.Queue("commit")
	err = r.schema.Q(conn).SendBatch(ctx, marks).Close()
	if conn.Conn().PgConn().TxStatus() == 'I' {
		open = false // committed, or PostgreSQL ended the transaction
	}
	if err != nil {
		return 0, fmt.Errorf("mark published and commit: %w", err)
	}
	if len(published) > 0 && r.cfg.OnPublishFunc != nil {
		r.cfg.OnPublishFunc(len(published), dups, time.Since(start))
	}
	if missingStream && r.cfg.RecoverFunc != nil {
		if err := r.cfg.RecoverFunc(ctx); err != nil {
			r.cfg.Logger.Warn("outbox relay: recreate the stream", "error", err)
		}
	}
	if failed > 0 {
		firstErr = fmt.Errorf("%d of %d rows not published; first: %w", failed, len(batch), firstErr)
	}
	return len(published), firstErr
}

// Backlog returns the number of unpublished rows of the outbox of schema
// ("" for idemsaga) and the age of the oldest.
func Backlog(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, schema string) (int64, time.Duration, error) {
	sch, err := pgschema.New(schema)
	if err != nil {
		return 0, 0, fmt.Errorf("outbox backlog: %w", err)
	}
	var n int64
	var age float64
	if err := q.QueryRow(ctx, sch.SQL(backlog)).Scan(&n, &age); err != nil {
		return 0, 0, fmt.Errorf("outbox backlog: %w", err)
	}
	return n, time.Duration(age * float64(time.Second)), nil
}
