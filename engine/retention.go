package engine

import (
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/maintenance"
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
const KeepForever time.Duration = maintenance.KeepForever

// Bounds checked by RetentionConfig.validate.
const (
	// minRecordWindow is the shortest FinishedSagas accepted: a
	// window shorter than the time a command can wait in the broker would
	// let a late delivery run a step a second time.
	minRecordWindow = time.Hour
	// maxRetentionBatch keeps each cleaning transaction short.
	maxRetentionBatch = 10_000
)

// RetentionConfig says how long the engine's records are kept and how the
// engine's cleaner deletes them. The zero value means every default.
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
	// cleaner. Defaults to RetentionIntervalDefault.
	Interval time.Duration
	// DeleteFailed lets the cleaner delete sagas in saga.StateFailed or
	// saga.StateParked once past FinishedSagas. Such a saga needs a person
	// (its compensation could not finish, or a step that may have taken
	// effect has no compensation) and Client.Retry resumes it from its step
	// and inbox records, so by default it is kept, with those records,
	// however old. A retried saga is running again and is never deleted.
	DeleteFailed bool
	// ArchiveDir, when set, makes the cleaner write every finished saga
	// it deletes (with its steps, attempts, inbox rows, callbacks,
	// repairs and dead letters, as saga.ArchivedSaga) to a new
	// gzip-compressed JSON Lines file in this directory, one file per
	// batch, and delete the batch only once the file is durable. A saga
	// deleted is in an archive; a crash between the file and the
	// deletion's commit puts it in a second file later, so readers dedupe
	// by saga ID. The directory must exist and be writable: the cleaner
	// checks it when it starts, and a pass that cannot write deletes no
	// saga and returns an error saying so. Empty (the default) archives
	// nothing.
	ArchiveDir string
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
	case c.ArchiveDir != "" && c.FinishedSagas == KeepForever:
		return fmt.Errorf("idemsaga: RetentionConfig.ArchiveDir is %q but FinishedSagas is KeepForever: no saga is ever deleted, so none is archived; unset one of them (worker run: --archive-dir or --no-retention)", c.ArchiveDir)
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

// cleaner is the cleaner's configuration from c, with its defaults; cl
// reads the sagas it archives.
func (c RetentionConfig) cleaner(cl *Client) maintenance.CleanerConfig {
	cfg := maintenance.CleanerConfig{FinishedSagas: c.FinishedSagas, PublishedOutbox: c.PublishedOutbox, BatchSize: c.BatchSize,
		Interval: c.Interval, DeleteFailed: c.DeleteFailed, ArchiveDir: c.ArchiveDir}
	if c.ArchiveDir != "" {
		cfg.Sagas = archiveReader{cl: cl}
	}
	return cfg
}
