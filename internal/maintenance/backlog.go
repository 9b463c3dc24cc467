package maintenance

import (
	"context"
	"math"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Backlog is the work waiting in the engine's stream as last read: the
// messages no worker has been given yet (undelivered on the engine's
// consumers) and when the oldest of them was stored, on this host's clock
// (its age is measured on the broker's). Messages delivered and
// not yet acknowledged are not counted: a worker has them, or had them and
// died, and the lease or AckWait answers for those, not the queue. The
// reaper and the API's load shedding share one reading.
type Backlog struct {
	Msgs   uint64
	Oldest time.Time
	// Drain is the wait the consumers' queues predict at the pace their
	// workers took messages lately: the longest of them.
	Drain Drain
	// At is when it was read; zero when no reading succeeded.
	At time.Time
}

// Drain is the time one consumer's queue takes to reach a worker at the
// pace the workers took its messages over the last drainWindow, counting
// only the spans in which the queue never ran dry (the workers, not the
// arrivals, set the pace then). Zero (Measured 0) when no consumer has
// messages waiting and such a pace: at start-up, after an idle spell, or
// while the workers keep up, nothing is predicted.
type Drain struct {
	// Consumer is the consumer whose queue takes longest; Queued its
	// messages no worker was given yet.
	Consumer string
	Queued   uint64
	// Rate is the messages a second its workers took, over Measured of
	// busy time (at least drainMeasuredMin).
	Rate     float64
	Measured time.Duration
	// Wait is Queued / Rate: DrainStalled when the workers took none.
	Wait time.Duration
}

// DrainStalled is a Drain's Wait when the workers took none of a queue's
// messages over the time measured.
const DrainStalled = time.Duration(math.MaxInt64)

// drainWindow is how far back the workers' pace is measured.
const drainWindow = 10 * time.Second

// drainMeasuredMin is the busy time a pace must be measured over before
// it predicts a wait: one reading's interval is too noisy to refuse work.
const drainMeasuredMin = 3 * time.Second

// OldestAge is the age of the oldest message at now, 0 when empty.
func (b Backlog) OldestAge(now time.Time) time.Duration {
	if b.Msgs == 0 || b.Oldest.IsZero() {
		return 0
	}
	return max(now.Sub(b.Oldest), 0)
}

// backlogEvery is how often the stream is read at most: every caller in
// the second that follows a reading shares it.
const backlogEvery = time.Second

// backlogStale is how old a reading may be and still be acted on.
const backlogStale = 5 * time.Second

// StreamBacklog reads a stream's state at most once every backlogEvery,
// whoever asks.
type StreamBacklog struct {
	js        jetstream.JetStream
	name      string
	consumers []string
	// reading is held by the one caller that reads the stream; others
	// take the last reading meanwhile.
	reading sync.Mutex
	// meters are the consumers' paces, by name; only the reader uses them.
	meters map[string]*drainMeter
	mu     sync.Mutex
	last   Backlog
	tried  time.Time
}

// NewStreamBacklog reads stream name's backlog on the given consumers.
func NewStreamBacklog(js jetstream.JetStream, name string, consumers ...string) *StreamBacklog {
	return &StreamBacklog{js: js, name: name, consumers: consumers, meters: map[string]*drainMeter{}}
}

// Get returns the latest reading, reading the stream first if the last
// try is older than backlogEvery. ok is false when no reading of the last
// backlogStale succeeded (no stream yet, the broker out of reach).
func (s *StreamBacklog) Get(ctx context.Context) (b Backlog, ok bool) {
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
	return b, !b.At.IsZero() && time.Since(b.At) <= backlogStale
}

// read asks each consumer how many messages it has not delivered yet and
// from which stream sequence on, then reads the first of them for its
// time: a work queue keeps delivered messages until they are acknowledged,
// so the stream's own first message may be one a dead worker held. Each
// consumer's delivered count feeds its pace (Drain).
func (s *StreamBacklog) read(ctx context.Context) (Backlog, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	if err != nil {
		return Backlog{}, err
	}
	var b Backlog
	for _, name := range s.consumers {
		c, err := st.Consumer(ctx, name)
		if err != nil {
			return Backlog{}, err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return Backlog{}, err
		}
		infoAt := time.Now()
		meter := s.meters[name]
		if meter == nil {
			meter = &drainMeter{}
			s.meters[name] = meter
		}
		meter.observe(meterReading{delivered: info.Delivered.Consumer, queued: info.NumPending, at: infoAt})
		if d := meter.drain(name, info.NumPending); d.Wait > b.Drain.Wait {
			b.Drain = d
		}
		if info.NumPending == 0 {
			continue
		}
		b.Msgs += info.NumPending
		m, err := st.GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(info.Config.FilterSubject))
		if err != nil {
			return Backlog{}, err
		}
		if t := storedAt(m.Time, info.TimeStamp, infoAt); b.Oldest.IsZero() || t.Before(b.Oldest) {
			b.Oldest = t
		}
	}
	b.At = time.Now()
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
