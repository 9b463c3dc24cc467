package engine

import (
	"context"
	"fmt"
	"math"
	"time"
)

// Overload is the error of a start shed because the engine's stream holds
// more work than ShedOldestAge or ShedStreamMessages allow: nothing was
// written.
type Overload struct {
	// Messages is the stream's messages no worker was given yet;
	// OldestAge the age of the oldest of them.
	Messages  uint64
	OldestAge time.Duration
	// Reason names the threshold passed.
	Reason string
	// RetryAfter is when a start is worth trying again.
	RetryAfter time.Duration
}

func (o *Overload) Error() string {
	return fmt.Sprintf("idemsaga: overloaded: %s (%d messages wait for a worker, the oldest %s old); nothing was written: retry the same request in %s",
		o.Reason, o.Messages, o.OldestAge.Round(100*time.Millisecond), o.RetryAfter)
}

// retryAfterMax bounds the wait an Overload suggests.
const retryAfterMax = 30 * time.Second

// ShedStart returns an *Overload when a saga of definition should not start
// now because the stream's backlog is above the shedding threshold
// (Config.ShedOldestAge, ShedStreamMessages), and counts it; nil otherwise,
// also when the stream's state is unknown (the broker's health is /readyz's
// to report). The stream is read at most once a second, whoever asks.
func (e *Engine) ShedStart(ctx context.Context, definition string) error {
	if e.cfg.ShedOldestAge == NoShedding && e.cfg.ShedStreamMessages == 0 {
		return nil
	}
	b, ok := e.backlog.Get(ctx)
	if !ok {
		return nil
	}
	age := b.OldestAge(time.Now())
	var o *Overload
	switch {
	case e.cfg.ShedOldestAge > 0 && age > e.cfg.ShedOldestAge:
		o = &Overload{Reason: fmt.Sprintf("the oldest command no worker was given yet has waited longer than %s", e.cfg.ShedOldestAge),
			RetryAfter: age - e.cfg.ShedOldestAge}
	case e.cfg.ShedStreamMessages > 0 && b.Msgs > uint64(e.cfg.ShedStreamMessages):
		o = &Overload{Reason: fmt.Sprintf("more than %d messages wait for a worker", e.cfg.ShedStreamMessages), RetryAfter: time.Second}
	default:
		return nil
	}
	o.Messages, o.OldestAge = b.Msgs, age
	o.RetryAfter = time.Duration(math.Ceil(min(max(o.RetryAfter, time.Second), retryAfterMax).Seconds())) * time.Second
	e.c.Metrics().StartsShed.WithLabelValues(definition).Inc()
	return o
}
