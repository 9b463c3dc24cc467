package engine

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/idemsaga/idemsaga/internal/maintenance"
)

// Overload is the error of a start shed because the engine's stream holds
// more work than ShedOldestAge or ShedStreamMessages allow: nothing was
// written.
type Overload struct {
	// Messages is the stream's messages no worker was given yet;
	// OldestAge the age of the oldest of them.
	Messages  uint64
	OldestAge time.Duration
	// Drain is the time the messages of the slowest queue take to reach a
	// worker at the pace the workers took them lately: 0 when no pace was
	// measured, DrainStalled when they took none.
	Drain time.Duration
	// Reason names the threshold passed.
	Reason string
	// RetryAfter is when a start is worth trying again.
	RetryAfter time.Duration
}

func (o *Overload) Error() string {
	return fmt.Sprintf("idemsaga: overloaded: %s (%d messages wait for a worker, the oldest %s old); nothing was written: retry the same request in %s",
		o.Reason, o.Messages, o.OldestAge.Round(100*time.Millisecond), o.RetryAfter)
}

// DrainStalled is Overload.Drain when the workers took none of the queued
// messages over the time their pace was measured.
const DrainStalled = maintenance.DrainStalled

// retryAfterMax bounds the wait an Overload suggests.
const retryAfterMax = 30 * time.Second

// stalledRetryAfter is the wait an Overload suggests when the workers
// took nothing lately: no pace says when they will.
const stalledRetryAfter = 5 * time.Second

// ShedStart returns an *Overload when a saga of definition should not start
// now, and counts it; nil otherwise. It sheds while, in this order:
//
//   - the oldest message no worker was given yet has waited longer than
//     Config.ShedOldestAge;
//   - more than Config.ShedStreamMessages (if positive) wait for a worker;
//   - the queued messages are predicted to wait longer than ShedOldestAge:
//     for each of the engine's consumers, its queued messages divided by
//     the messages a second its workers took over the last 10 s in which
//     its queue never ran dry (at least 3 s of such time measured), the
//     longest of them. Without such a measurement (start-up, after an idle
//     spell, while the workers keep up) nothing is predicted and this rule
//     sheds nothing: a first burst is judged by the age rule until the
//     workers' pace under it is known.
//
// NoShedding as ShedOldestAge turns off both time rules. Nothing is shed
// while the stream's state is unknown (the broker's health is /readyz's to
// report). The stream is read at most once a second, whoever asks.
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
	case e.cfg.ShedOldestAge > 0 && b.Drain.Wait > e.cfg.ShedOldestAge:
		o = &Overload{Reason: drainReason(b.Drain, e.cfg.ShedOldestAge), RetryAfter: stalledRetryAfter}
		if b.Drain.Wait != DrainStalled {
			o.RetryAfter = b.Drain.Wait - e.cfg.ShedOldestAge
		}
	default:
		return nil
	}
	o.Messages, o.OldestAge, o.Drain = b.Msgs, age, b.Drain.Wait
	o.RetryAfter = time.Duration(math.Ceil(min(max(o.RetryAfter, time.Second), retryAfterMax).Seconds())) * time.Second
	e.c.Metrics().StartsShed.WithLabelValues(definition).Inc()
	return o
}

// drainReason says why a predicted wait sheds a start.
func drainReason(d maintenance.Drain, bound time.Duration) string {
	if d.Wait == DrainStalled {
		return fmt.Sprintf("the workers took none of the %d messages queued on consumer %s over the last %s, so none can be expected to reach a worker within %s",
			d.Queued, d.Consumer, d.Measured.Round(100*time.Millisecond), bound)
	}
	return fmt.Sprintf("at the pace the workers took them lately (%.1f a second over %s), the %d messages queued on consumer %s take %s to reach a worker, longer than %s",
		d.Rate, d.Measured.Round(100*time.Millisecond), d.Queued, d.Consumer, d.Wait.Round(100*time.Millisecond), bound)
}
