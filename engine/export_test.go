package engine

import (
	"context"
	"time"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/wire"
)

// HandleCommand and ApplyReply let the external tests drive one command
// or reply by hand; they take the engine's internal wire types, so they
// are not part of the public API.
func (e *Engine) HandleCommand(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return e.handleCommand(ctx, cmd)
}

func (e *Engine) ApplyReply(ctx context.Context, r wire.Reply) (Verdict, error) {
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
	return e.c.resumeDeadLetters(ctx, resumeBatch)
}
