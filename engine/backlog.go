package engine

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// backlog is the work waiting in the engine's stream as last read: the
// messages no worker has been given yet (undelivered on the engine's
// consumers) and when the oldest of them was stored, on this host's clock
// (its age is measured on the broker's). Messages delivered and
// not yet acknowledged are not counted: a worker has them, or had them and
// died, and the lease or AckWait answers for those, not the queue. The
// reaper and the API's load shedding share one reading.
type backlog struct {
	msgs   uint64
	oldest time.Time
	// at is when it was read; zero when no reading succeeded.
	at time.Time
}

// oldestAge is the age of the oldest message at now, 0 when empty.
func (b backlog) oldestAge(now time.Time) time.Duration {
	if b.msgs == 0 || b.oldest.IsZero() {
		return 0
	}
	return max(now.Sub(b.oldest), 0)
}

// backlogEvery is how often the stream is read at most: every caller in
// the second that follows a reading shares it.
const backlogEvery = time.Second

// backlogStale is how old a reading may be and still be acted on.
const backlogStale = 5 * time.Second

// streamBacklog reads a stream's state at most once every backlogEvery,
// whoever asks.
type streamBacklog struct {
	js        jetstream.JetStream
	name      string
	consumers []string
	// reading is held by the one caller that reads the stream; others
	// take the last reading meanwhile.
	reading sync.Mutex
	mu      sync.Mutex
	last    backlog
	tried   time.Time
}

func newStreamBacklog(js jetstream.JetStream, name string, consumers ...string) *streamBacklog {
	return &streamBacklog{js: js, name: name, consumers: consumers}
}

// get returns the latest reading, reading the stream first if the last
// try is older than backlogEvery. ok is false when no reading of the last
// backlogStale succeeded (no stream yet, the broker out of reach).
func (s *streamBacklog) get(ctx context.Context) (b backlog, ok bool) {
	s.mu.Lock()
	due := time.Since(s.tried) >= backlogEvery
	b = s.last
	s.mu.Unlock()
	if due && s.reading.TryLock() {
		s.mu.Lock()
		due = time.Since(s.tried) >= backlogEvery
		if due {
			s.tried = time.Now()
		}
		s.mu.Unlock()
		if due {
			if nb, err := s.read(ctx); err == nil {
				s.mu.Lock()
				s.last = nb
				s.mu.Unlock()
				b = nb
			}
		}
		s.reading.Unlock()
	}
	return b, !b.at.IsZero() && time.Since(b.at) <= backlogStale
}

// read asks each consumer how many messages it has not delivered yet and
// from which stream sequence on, then reads the first of them for its
// time: a work queue keeps delivered messages until they are acknowledged,
// so the stream's own first message may be one a dead worker held.
func (s *streamBacklog) read(ctx context.Context) (backlog, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	if err != nil {
		return backlog{}, err
	}
	var b backlog
	for _, name := range s.consumers {
		c, err := st.Consumer(ctx, name)
		if err != nil {
			return backlog{}, err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return backlog{}, err
		}
		infoAt := time.Now()
		if info.NumPending == 0 {
			continue
		}
		b.msgs += info.NumPending
		m, err := st.GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(info.Config.FilterSubject))
		if err != nil {
			return backlog{}, err
		}
		if t := storedAt(m.Time, info.TimeStamp, infoAt); b.oldest.IsZero() || t.Before(b.oldest) {
			b.oldest = t
		}
	}
	b.at = time.Now()
	return b, nil
}

// storedAt places a message stored at stored (broker clock) on this host's
// clock, by its age at the broker's time serverNow, read here at localNow:
// the two clocks may differ. A server that does not tell its time (before
// nats-server 2.10) leaves the stored time as it is.
func storedAt(stored, serverNow, localNow time.Time) time.Time {
	if serverNow.IsZero() {
		return stored
	}
	return localNow.Add(-serverNow.Sub(stored))
}

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
	b, ok := e.backlog.get(ctx)
	if !ok {
		return nil
	}
	age := b.oldestAge(time.Now())
	var o *Overload
	switch {
	case e.cfg.ShedOldestAge > 0 && age > e.cfg.ShedOldestAge:
		o = &Overload{Reason: fmt.Sprintf("the oldest command no worker was given yet has waited longer than %s", e.cfg.ShedOldestAge),
			RetryAfter: age - e.cfg.ShedOldestAge}
	case e.cfg.ShedStreamMessages > 0 && b.msgs > uint64(e.cfg.ShedStreamMessages):
		o = &Overload{Reason: fmt.Sprintf("more than %d messages wait for a worker", e.cfg.ShedStreamMessages), RetryAfter: time.Second}
	default:
		return nil
	}
	o.Messages, o.OldestAge = b.msgs, age
	o.RetryAfter = time.Duration(math.Ceil(min(max(o.RetryAfter, time.Second), retryAfterMax).Seconds())) * time.Second
	e.c.metrics.StartsShed.WithLabelValues(definition).Inc()
	return o
}
