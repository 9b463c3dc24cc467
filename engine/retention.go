package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemsaga/idemsaga/internal/store"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
)

// Defaults of RetentionConfig.
const (
	// FinishedSagasDefault keeps a finished saga, its steps and its inbox
	// rows for 7 days after it finished: the replay window.
	FinishedSagasDefault = 7 * 24 * time.Hour
	// PublishedOutboxDefault (0) deletes an outbox row as soon as the
	// broker acknowledged it, in the relay's own transaction.
	PublishedOutboxDefault time.Duration = 0
	// RetentionBatchSizeDefault is the most rows (or sagas) one cleaning
	// transaction deletes.
	RetentionBatchSizeDefault = 500
	// RetentionIntervalDefault is the pause between two cleaning passes.
	RetentionIntervalDefault = time.Minute
)

// KeepForever, as RetentionConfig.FinishedSagas or PublishedOutbox, keeps
// those records forever.
const KeepForever time.Duration = -1

// markedOutboxWindow is how long the cleaner keeps rows marked published
// when PublishedOutbox is 0: rows left by an engine that marks them (a
// positive PublishedOutbox, or a version before the relay deleted them).
const markedOutboxWindow = time.Hour

// Bounds checked by RetentionConfig.validate.
const (
	// minRecordWindow is the shortest FinishedSagas accepted: a
	// window shorter than the time a command can wait in the broker would
	// let a late delivery run a step a second time.
	minRecordWindow = time.Hour
	// maxRetentionBatch keeps each cleaning transaction short.
	maxRetentionBatch = 10_000
	// retentionBatchTimeout bounds one cleaning transaction.
	retentionBatchTimeout = 30 * time.Second
)

// RetentionConfig says how long the engine's records are kept and how the
// Cleaner deletes them. The zero value means every default.
//
// Rules, all measured on the database clock (idemsaga.now()):
//
//   - A saga is deleted only once it is finished (finished_at set) and
//     older than FinishedSagas, never while it runs, never while one of its
//     steps is still dispatched or waiting for a retry, and never in
//     saga.StateFailed or saga.StateParked (it needs a person) unless
//     DeleteFailed is set. Its steps, their attempts and its inbox rows go
//     in the same transaction (the schema's foreign keys cascade), so a
//     saga's dedup records never outlive it or die before it.
//   - A published outbox row is deleted by the relay at once, or, if
//     PublishedOutbox is set, marked and deleted by the cleaner once it is
//     older than that (an hour for rows marked while PublishedOutbox is
//     0: by another engine, or an older version). An unpublished row is
//     never deleted, however old.
//   - A submit token (Client.IssueToken) is deleted once it expired,
//     used or not: a used one's saga holds it as its key, for as long as
//     the saga is kept.
//
// Past FinishedSagas the saga's idempotency key is free again: Start with
// the same key creates a new saga, with a new ID and so new step keys.
// FinishedSagas is therefore the replay window: the time during which a
// duplicate request, a redelivered command or an operator's replay is
// recognised. It must exceed the longest time a command can stay in the
// broker (a consumer backlog during an outage, say). A command delivered
// after its saga is gone finds no saga to claim a key of, and is dropped
// with a warning: it never runs its step again.
type RetentionConfig struct {
	// FinishedSagas is how long a finished saga, its steps and its inbox
	// rows are kept after finished_at. It is the replay window: within it a
	// start with the same key returns the same saga; past it, the key starts
	// a new one. At least one hour, or KeepForever. Defaults to
	// FinishedSagasDefault.
	FinishedSagas time.Duration
	// PublishedOutbox is how long a published outbox row is kept after
	// published_at. 0 (the default) keeps none: the relay deletes each row
	// in the transaction that saw the broker's ack, which costs the least
	// (no update, no index entry, no later delete). A positive value,
	// which must exceed the broker's 2-minute Nats-Msg-Id dedup window
	// (broker.DuplicateWindowDefault), makes the relay mark rows published
	// instead and the cleaner delete them past the window, so that every
	// copy the broker may still drop as a duplicate can be traced to its
	// row. KeepForever marks them and keeps them. Neither affects
	// delivery: the row was already published, and a lost message is
	// re-driven by its step's lease.
	PublishedOutbox time.Duration
	// BatchSize is the most sagas, inbox rows or outbox rows one cleaning
	// transaction deletes (a saga's steps and inbox rows go with it), at
	// most 10,000. Small batches keep locks short and let autovacuum keep
	// up. Defaults to RetentionBatchSizeDefault.
	BatchSize int
	// Interval is the pause between two cleaning passes of a started
	// Cleaner. Defaults to RetentionIntervalDefault.
	Interval time.Duration
	// DeleteFailed lets the Cleaner delete sagas in saga.StateFailed or
	// saga.StateParked once past FinishedSagas. Such a saga needs a person
	// (its compensation could not finish, or a step that may have taken
	// effect has no compensation) and Client.Retry resumes it from its step
	// and inbox records, so by default it is kept, with those records,
	// however old. A retried saga is running again and is never deleted.
	DeleteFailed bool
}

// WithDefaults returns a copy of c with its zero fields set to their
// defaults.
func (c RetentionConfig) WithDefaults() RetentionConfig {
	if c.FinishedSagas == 0 {
		c.FinishedSagas = FinishedSagasDefault
	}
	if c.BatchSize == 0 {
		c.BatchSize = RetentionBatchSizeDefault
	}
	if c.Interval == 0 {
		c.Interval = RetentionIntervalDefault
	}
	return c
}

// validate checks c, defaults applied.
func (c RetentionConfig) validate() error {
	switch {
	case c.FinishedSagas < 0 && c.FinishedSagas != KeepForever:
		return fmt.Errorf("idemsaga: RetentionConfig.FinishedSagas is %s; use a duration of at least %s, 0 for the default, or KeepForever", c.FinishedSagas, minRecordWindow)
	case c.FinishedSagas >= 0 && c.FinishedSagas < minRecordWindow:
		return fmt.Errorf("idemsaga: RetentionConfig.FinishedSagas is %s, under the %s minimum: it is the replay window, and a command delivered after it could run its step again", c.FinishedSagas, minRecordWindow)
	case c.PublishedOutbox < 0 && c.PublishedOutbox != KeepForever:
		return fmt.Errorf("idemsaga: RetentionConfig.PublishedOutbox is %s; use a positive duration, 0 to delete rows as soon as they are published, or KeepForever", c.PublishedOutbox)
	case c.PublishedOutbox > 0 && c.PublishedOutbox <= broker.DuplicateWindowDefault:
		return fmt.Errorf("idemsaga: RetentionConfig.PublishedOutbox is %s; it must exceed the broker's %s dedup window, or be 0 to delete rows as soon as they are published", c.PublishedOutbox, broker.DuplicateWindowDefault)
	case c.Interval < 0:
		return fmt.Errorf("idemsaga: RetentionConfig.Interval is %s; use a positive duration, or 0 for the default", c.Interval)
	case c.BatchSize < 0:
		return fmt.Errorf("idemsaga: RetentionConfig.BatchSize is %d; use a positive number, or 0 for %d", c.BatchSize, RetentionBatchSizeDefault)
	case c.BatchSize > maxRetentionBatch:
		return fmt.Errorf("idemsaga: RetentionConfig.BatchSize is %d, over %d; keep cleaning transactions small", c.BatchSize, maxRetentionBatch)
	}
	return nil
}

// cleans reports whether a cleaner of c has anything to delete: finished
// sagas, or published rows kept for a while.
func (c RetentionConfig) cleans() bool {
	return c.FinishedSagas != KeepForever || c.PublishedOutbox > 0
}

// Retention SQL. Every window is a number of milliseconds compared with
// idemsaga.now(), the database clock. Candidates are claimed with FOR UPDATE SKIP
// LOCKED, so any number of cleaners can run at once, each deleting a row
// at most once.
const (
	retentionLockTimeout = `select set_config('lock_timeout', '5s', true)`
)

// CleanResult counts what one CleanOnce deleted, per table.
type CleanResult struct {
	// Sagas is the number of finished sagas deleted.
	Sagas int64
	// Steps is the number of step rows deleted with those sagas. Their
	// attempts' rows go too, uncounted.
	Steps int64
	// Inbox is the number of inbox rows deleted with those sagas.
	Inbox int64
	// Outbox is the number of published outbox rows deleted.
	Outbox int64
	// SubmitTokens is the number of expired submit tokens deleted.
	SubmitTokens int64
	// Batches is the number of committed transactions that deleted at
	// least one row.
	Batches int
}

func (r *CleanResult) add(o CleanResult) {
	r.Sagas += o.Sagas
	r.Steps += o.Steps
	r.Inbox += o.Inbox
	r.Outbox += o.Outbox
	r.SubmitTokens += o.SubmitTokens
	r.Batches += o.Batches
}

// Cleaner deletes the engine's records once their retention window has
// passed (see RetentionConfig for the rules), in small batches, each its
// own short transaction. Any number of cleaners, in any number of
// processes, may run on one database at once.
type Cleaner struct {
	pool   *pgxpool.Pool
	cfg    RetentionConfig
	log    *slog.Logger
	runner lifecycle.Runner
}

// NewCleaner returns a cleaner of pool's idemsaga tables; Start runs it,
// CleanOnce runs one pass. Zero fields of cfg take their defaults; a nil
// logger means slog.Default().
func NewCleaner(pool *pgxpool.Pool, cfg RetentionConfig, logger *slog.Logger) (*Cleaner, error) {
	if pool == nil {
		return nil, errors.New("idemsaga: NewCleaner needs a pool: open one with pgxpool.New(ctx, DATABASE_URL)")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	return &Cleaner{pool: pool, cfg: cfg, log: logger}, nil
}

// Config returns the cleaner's configuration, with defaults filled in.
func (c *Cleaner) Config() RetentionConfig { return c.cfg }

// Start checks the database and cleans in the background, at once and then
// every Interval, until Stop. It returns at once.
func (c *Cleaner) Start(ctx context.Context) error {
	if err := c.pool.Ping(ctx); err != nil {
		return fmt.Errorf("idemsaga: cleaner: database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	return c.runner.Start(ctx, c.loop)
}

// Stop ends the background cleaning after the batch in hand and waits for
// it, or for ctx to end. Calling it twice is fine.
func (c *Cleaner) Stop(ctx context.Context) error { return c.runner.Stop(ctx) }

func (c *Cleaner) loop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		res, err := c.CleanOnce(ctx)
		if err != nil && ctx.Err() == nil {
			c.log.Warn("retention: cleaning pass failed; will retry", "error", err)
		}
		if res.Batches > 0 {
			c.log.Info("retention: deleted expired records",
				"sagas", res.Sagas, "steps", res.Steps, "inbox", res.Inbox, "outbox", res.Outbox, "submit_tokens", res.SubmitTokens, "batches", res.Batches)
		}
		t.Reset(c.cfg.Interval)
	}
}

// CleanOnce deletes every record past its window: finished sagas with
// their steps, inbox rows and repair records, then published outbox
// rows, then expired submit tokens. Each kind is deleted batch after
// batch, each batch its own transaction, until a batch comes back short (the rest, if
// any, is held by another cleaner, which deletes it). When ctx ends, it
// stops between batches; a batch in hand finishes under its own timeout.
// On error it returns what it deleted so far, having still tried the other
// kinds.
func (c *Cleaner) CleanOnce(ctx context.Context) (CleanResult, error) {
	var total CleanResult
	var errs []error
	for _, pass := range []struct {
		what  string
		batch func(context.Context) (CleanResult, int64, error)
	}{
		{"finished sagas", c.sagaBatch},
		{"published outbox rows", c.outboxBatch},
		{"expired submit tokens", c.submitTokenBatch},
	} {
		for ctx.Err() == nil {
			bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), retentionBatchTimeout)
			res, n, err := pass.batch(bctx)
			cancel()
			if err != nil {
				errs = append(errs, fmt.Errorf("idemsaga: retention: delete %s: %w", pass.what, err))
				break
			}
			if n > 0 {
				res.Batches = 1
			}
			total.add(res)
			if n < int64(c.cfg.BatchSize) {
				break
			}
		}
	}
	if err := ctx.Err(); err != nil {
		errs = append(errs, fmt.Errorf("idemsaga: retention: pass interrupted: %w", err))
	}
	return total, errors.Join(errs...)
}

// sagaBatch deletes one batch of finished sagas with their steps and inbox
// rows, together. It returns the number of sagas as its size.
func (c *Cleaner) sagaBatch(ctx context.Context) (CleanResult, int64, error) {
	var res CleanResult
	if c.cfg.FinishedSagas == KeepForever {
		return res, 0, nil
	}
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, retentionLockTimeout); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, store.ClaimFinishedSagas, c.cfg.FinishedSagas.Milliseconds(), c.cfg.BatchSize, c.cfg.DeleteFailed)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		if err != nil || len(ids) == 0 {
			return err
		}
		b := &pgx.Batch{}
		b.Queue(store.DeleteSagaInbox, ids).Exec(func(tag pgconn.CommandTag) error {
			res.Inbox = tag.RowsAffected()
			return nil
		})
		b.Queue(store.DeleteSagaAttempts, ids)
		b.Queue(store.DeleteSagaSteps, ids).Exec(func(tag pgconn.CommandTag) error {
			res.Steps = tag.RowsAffected()
			return nil
		})
		b.Queue(store.DeleteSagas, ids).Exec(func(tag pgconn.CommandTag) error {
			res.Sagas = tag.RowsAffected()
			return nil
		})
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return CleanResult{}, 0, err
	}
	return res, res.Sagas, nil
}

// outboxBatch deletes one batch of published outbox rows. With
// PublishedOutbox 0 the relay deletes what it publishes; the cleaner still
// deletes rows marked published (by an engine that keeps them, or by a
// version before the relay deleted) once they are an hour old.
func (c *Cleaner) outboxBatch(ctx context.Context) (CleanResult, int64, error) {
	window := c.cfg.PublishedOutbox
	switch window {
	case KeepForever:
		return CleanResult{}, 0, nil
	case 0:
		window = markedOutboxWindow
	}
	n, err := c.deleteBatch(ctx, store.DeletePublishedOutbox, window)
	return CleanResult{Outbox: n}, n, err
}

// submitTokenBatch deletes one batch of expired submit tokens.
func (c *Cleaner) submitTokenBatch(ctx context.Context) (CleanResult, int64, error) {
	n, err := c.deleteBatch(ctx, store.DeleteExpiredSubmitTokens, 0)
	return CleanResult{SubmitTokens: n}, n, err
}

// deleteBatch runs one single-statement delete in its own transaction.
func (c *Cleaner) deleteBatch(ctx context.Context, sql string, window time.Duration) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, retentionLockTimeout); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, sql, window.Milliseconds(), c.cfg.BatchSize)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}
