package engine

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/jackc/pgx/v5/pgxpool"
)

// HandleCommand and ApplyReply let the external tests drive one command
// or reply by hand; they take the engine's internal wire types, so they
// are not part of the public API.
func (e *Engine) HandleCommand(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return e.handleCommand(ctx, cmd)
}

func (e *Engine) ApplyReply(ctx context.Context, r wire.Reply) (orchestrate.Verdict, error) {
	return e.applyReply(ctx, r)
}

// ReapOnce runs one pass of the reaper, as its loop does.
func (e *Engine) ReapOnce(ctx context.Context) (int, error) { return e.reapOnce(ctx) }

// WithDeadLetters shortens the engine's dead-letter bound for tests: a
// command its step workers cannot run is parked after deliveries, with
// waits of backoff between them.
func WithDeadLetters(cfg *Config, deliveries int, backoff time.Duration) {
	cfg.deadLetters = attempt.DeadLetterPolicy{Deliveries: deliveries, Backoff: backoff, MaxBackoff: backoff}
}

// ResumeDeadLetters runs one pass of the engine's dead-letter resumer,
// as its heartbeat does.
func (e *Engine) ResumeDeadLetters(ctx context.Context) (int, error) {
	return e.c.ResumeDeadLetters(ctx, orchestrate.ResumeBatch)
}

// NewCleaner returns the cleaner an engine runs with cfg (its zero fields
// defaulted, then checked), for the tests of retention.
func NewCleaner(pool *pgxpool.Pool, cfg RetentionConfig, logger *slog.Logger) (*maintenance.Cleaner, error) {
	if pool == nil {
		return nil, errors.New("idemsaga: NewCleaner needs a pool")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	cl, err := NewClient(Config{Pool: pool, Logger: logger})
	if err != nil {
		return nil, err
	}
	return maintenance.NewCleaner(pool, cfg.cleaner(cl), logger), nil
}

// The verdicts ApplyReply returns.
const (
	VerdictApplied   = orchestrate.VerdictApplied
	VerdictDuplicate = orchestrate.VerdictDuplicate
	VerdictStale     = orchestrate.VerdictStale
	VerdictMissing   = orchestrate.VerdictMissing
)
