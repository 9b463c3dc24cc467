package attempt

import (
	"context"
	"sync"
	"time"
)

// stretch is a context whose deadline an attempt's heartbeat pushes
// forward (saga.StepContext.Heartbeat): the step's Timeout bounds the time
// between heartbeats, not the whole call. Its Deadline is the current one;
// a context derived from it before a heartbeat keeps the deadline it saw
// in Deadline, and ends with it when it ends.
type stretch struct {
	context.Context
	parent context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	deadline time.Time
	timer    *time.Timer
	expired  bool
}

// withStretch returns a context that ends d from now unless extend pushes
// it, or when parent ends.
func withStretch(parent context.Context, d time.Duration) (*stretch, context.CancelFunc) {
	ctx, cancel := context.WithCancel(parent)
	s := &stretch{Context: ctx, parent: parent, cancel: cancel, deadline: time.Now().Add(d)}
	if pd, ok := parent.Deadline(); ok && pd.Before(s.deadline) {
		s.deadline = pd
	}
	s.timer = time.AfterFunc(time.Until(s.deadline), s.expire)
	return s, func() {
		s.timer.Stop()
		cancel()
	}
}

func (s *stretch) expire() {
	s.mu.Lock()
	if time.Now().Before(s.deadline) {
		// Pushed since the timer was set.
		s.timer.Reset(time.Until(s.deadline))
		s.mu.Unlock()
		return
	}
	s.expired = true
	s.mu.Unlock()
	s.cancel()
}

// extend pushes the deadline to d from now, unless the context ended.
// The parent's deadline, if any, still bounds it.
func (s *stretch) extend(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.expired || s.Context.Err() != nil {
		return
	}
	next := time.Now().Add(d)
	if pd, ok := s.Context.Deadline(); ok && pd.Before(next) {
		next = pd
	}
	if next.After(s.deadline) {
		s.deadline = next
	}
}

func (s *stretch) Deadline() (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline, true
}

// Value looks up the parent's values, not the inner context's: a context
// derived from the stretch then follows it through Done and Err (and ends
// with DeadlineExceeded when it expires), rather than the inner one.
func (s *stretch) Value(key any) any { return s.parent.Value(key) }

func (s *stretch) Err() error {
	err := s.Context.Err()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil && s.expired {
		return context.DeadlineExceeded
	}
	return err
}
