package attempt

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestStretchEndsAtItsDeadline: a stretch ends with DeadlineExceeded when
// its time runs out, later when extended first, and never past its
// parent's deadline.
func TestStretchEndsAtItsDeadline(t *testing.T) {
	t.Parallel()
	s, cancel := withStretch(context.Background(), 50*time.Millisecond)
	defer cancel()
	first, ok := s.Deadline()
	require.True(t, ok)
	time.Sleep(20 * time.Millisecond)
	s.extend(200 * time.Millisecond)
	pushed, _ := s.Deadline()
	require.True(t, pushed.After(first), "extend moves the deadline on")
	child, cancelChild := context.WithCancel(s)
	defer cancelChild()
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stretch never ended")
	}
	require.ErrorIs(t, s.Err(), context.DeadlineExceeded)
	require.False(t, time.Now().Before(pushed), "it ended at its pushed deadline, not before")
	select {
	case <-child.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a context derived from the stretch did not end with it")
	}
	require.ErrorIs(t, child.Err(), context.DeadlineExceeded, "a context derived from it ends with it, as expired")

	parent, cancelParent := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancelParent()
	bounded, cancel2 := withStretch(parent, time.Hour)
	defer cancel2()
	bounded.extend(time.Hour)
	pd, _ := parent.Deadline()
	bd, _ := bounded.Deadline()
	require.False(t, bd.After(pd), "never past its parent's deadline")
	<-bounded.Done()

	ended, cancel3 := withStretch(context.Background(), time.Hour)
	cancel3()
	require.ErrorIs(t, ended.Err(), context.Canceled, "cancelled, not expired")
}
