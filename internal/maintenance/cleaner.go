// Package maintenance holds the engine's background housekeeping that
// moves no saga: the retention cleaner and the collectors of the gauges a
// scrape reads from the database and the stream.
package maintenance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"
)

// KeepForever, as CleanerConfig.FinishedSagas or PublishedOutbox, keeps
// those records forever.
const KeepForever time.Duration = -1

// CleanerConfig is what a Cleaner deletes and how; the engine's
// RetentionConfig gives it, with its defaults filled in and checked.
type CleanerConfig struct {
	FinishedSagas, PublishedOutbox time.Duration
	BatchSize                      int
	Interval                       time.Duration
	DeleteFailed                   bool
	// Schema is the deployment's schema; nil for pgschema.SchemaDefault.
	Schema *pgschema.Schema
	// ArchiveDir, when set, is the directory each batch of finished sagas
	// is written to (one new file a batch, by Sagas) before the batch is
	// deleted, in the transaction that holds their locks.
	ArchiveDir string
	// Sagas reads the archive's lines; needed with ArchiveDir.
	Sagas SagaReader
}

const (
	// markedOutboxWindow is how long the cleaner keeps rows marked
	// published when PublishedOutbox is 0: rows left by an engine that
	// marks them (a positive PublishedOutbox, or a version before the
	// relay deleted them).
	markedOutboxWindow = time.Hour
	// batchTimeout bounds one cleaning transaction.
	batchTimeout = 30 * time.Second
	// lockTimeout makes a cleaning transaction give up on a row lock
	// rather than queue behind a worker. Every window is a number of
	// milliseconds compared with idemsaga.now(), the database clock;
	// candidates are claimed with FOR UPDATE SKIP LOCKED, so any number of
	// cleaners can run at once, each deleting a row at most once.
	lockTimeout = `select set_config('lock_timeout', '5s', true)`
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
	// LimitHolds is the number of lapsed holds of shared limits deleted
	// (their process died while it held them).
	LimitHolds int64
	// Archived is the number of finished sagas written to archive files
	// before they were deleted (CleanerConfig.ArchiveDir).
	Archived int64
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
	r.LimitHolds += o.LimitHolds
	r.Archived += o.Archived
	r.Batches += o.Batches
}

// Cleaner deletes the engine's records once their retention window has
// passed (see the engine's RetentionConfig for the rules), in small batches, each its
// own short transaction. Any number of cleaners, in any number of
// processes, may run on one database at once.
type Cleaner struct {
	pool   *pgxpool.Pool
	cfg    CleanerConfig
	log    *slog.Logger
	runner lifecycle.Runner
}

// NewCleaner returns a cleaner of pool's idemsaga tables; Start runs it,
// CleanOnce runs one pass. cfg is taken as it is: the engine fills in and
// checks its RetentionConfig first.
func NewCleaner(pool *pgxpool.Pool, cfg CleanerConfig, logger *slog.Logger) *Cleaner {
	return &Cleaner{pool: pool, cfg: cfg, log: logger}
}

// Config returns the cleaner's configuration.
func (c *Cleaner) Config() CleanerConfig { return c.cfg }

// Start checks the database, and the archive directory if there is one,
// and cleans in the background, at once and then every Interval, until
// Stop. It returns at once.
func (c *Cleaner) Start(ctx context.Context) error {
	if err := c.pool.Ping(ctx); err != nil {
		return fmt.Errorf("idemsaga: cleaner: database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	if c.cfg.ArchiveDir != "" {
		if err := checkArchiveDir(c.cfg.ArchiveDir); err != nil {
			return err
		}
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
				"sagas", res.Sagas, "archived", res.Archived, "steps", res.Steps, "inbox", res.Inbox, "outbox", res.Outbox, "submit_tokens", res.SubmitTokens, "batches", res.Batches)
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
		{"lapsed limit holds", c.limitHoldBatch},
	} {
		for ctx.Err() == nil {
			bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchTimeout)
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
//
// With an archive directory, the batch's sagas are read under the locks
// that claimed them and written to a new file, which is durable before
// the deletes run and the transaction commits: a saga deleted is in an
// archive. A crash or a failed commit after the file's rename leaves the
// sagas in the database and in that file, and a later pass archives them
// again: in two files, never in none. Another cleaner skips the locked
// rows, so two cleaners never archive and delete one batch between them.
func (c *Cleaner) sagaBatch(ctx context.Context) (CleanResult, int64, error) {
	var res CleanResult
	if c.cfg.FinishedSagas == KeepForever {
		return res, 0, nil
	}
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if _, err := c.cfg.Schema.Q(tx).Exec(ctx, lockTimeout); err != nil {
			return err
		}
		rows, err := c.cfg.Schema.Q(tx).Query(ctx, store.ClaimFinishedSagas, c.cfg.FinishedSagas.Milliseconds(), c.cfg.BatchSize, c.cfg.DeleteFailed)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		if err != nil || len(ids) == 0 {
			return err
		}
		if c.cfg.ArchiveDir != "" {
			if res.Archived, err = c.archive(ctx, tx, ids); err != nil {
				return err
			}
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
		return c.cfg.Schema.Q(tx).SendBatch(ctx, b).Close()
	})
	if err != nil {
		return CleanResult{}, 0, err
	}
	return res, res.Sagas, nil
}

// archive writes the sagas ids, locked by tx, to a new archive file and
// returns how many it wrote once the file is durable.
func (c *Cleaner) archive(ctx context.Context, tx pgx.Tx, ids []uuid.UUID) (int64, error) {
	if c.cfg.Sagas == nil {
		return 0, errors.New("idemsaga: retention: an archive directory is set but no saga reader (CleanerConfig.Sagas); nothing was deleted")
	}
	lines, err := c.cfg.Sagas.ReadSagas(ctx, tx, ids)
	if err != nil {
		return 0, fmt.Errorf("read the sagas to archive (nothing was deleted): %w", err)
	}
	if len(lines) != len(ids) {
		return 0, fmt.Errorf("idemsaga: retention: read %d of the %d sagas to archive; nothing was deleted", len(lines), len(ids))
	}
	for i, l := range lines {
		if l == nil || l.Saga.ID != ids[i] {
			return 0, fmt.Errorf("idemsaga: retention: saga %s was not read for its archive; nothing was deleted", ids[i])
		}
	}
	path, err := writeArchive(c.cfg.ArchiveDir, lines)
	if err != nil {
		return 0, fmt.Errorf("nothing was deleted: %w", err)
	}
	c.log.Debug("retention: archived finished sagas", "file", path, "sagas", len(lines))
	return int64(len(lines)), nil
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

// limitHoldBatch deletes one batch of holds of shared limits that lapsed
// over a minute ago.
func (c *Cleaner) limitHoldBatch(ctx context.Context) (CleanResult, int64, error) {
	n, err := c.deleteBatch(ctx, store.DeleteLapsedHolds, time.Minute)
	return CleanResult{LimitHolds: n}, n, err
}

// deleteBatch runs one single-statement delete in its own transaction.
func (c *Cleaner) deleteBatch(ctx context.Context, sql string, window time.Duration) (int64, error) {
	var n int64
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if _, err := c.cfg.Schema.Q(tx).Exec(ctx, lockTimeout); err != nil {
			return err
		}
		tag, err := c.cfg.Schema.Q(tx).Exec(ctx, sql, window.Milliseconds(), c.cfg.BatchSize)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}
