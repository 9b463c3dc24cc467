package lifecycle_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/internal/lifecycle"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartStop(t *testing.T) {
	var r lifecycle.Runner
	var finished atomic.Bool
	require.NoError(t, r.Start(context.Background(), func(ctx context.Context) {
		<-ctx.Done()
		time.Sleep(10 * time.Millisecond) // work in hand
		finished.Store(true)
	}))
	require.ErrorIs(t, r.Start(context.Background(), func(context.Context) {}), lifecycle.ErrAlreadyStarted)
	require.True(t, r.Running())
	require.NoError(t, r.Stop(context.Background()))
	require.True(t, finished.Load(), "Stop waits for loops to return")
	require.NoError(t, r.Stop(context.Background()), "stopping twice is fine")
	require.False(t, r.Running())
}

func TestStartIgnoresCallerCancellation(t *testing.T) {
	var r lifecycle.Runner
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	require.NoError(t, r.Start(ctx, func(ctx context.Context) { <-ctx.Done(); close(stopped) }))
	cancel()
	select {
	case <-stopped:
		t.Fatal("cancelling Start's context must not stop the service; Stop does")
	case <-time.After(20 * time.Millisecond):
	}
	require.NoError(t, r.Stop(context.Background()))
	<-stopped
}

func TestStopGivesUpAtDeadline(t *testing.T) {
	var r lifecycle.Runner
	release := make(chan struct{})
	require.NoError(t, r.Start(context.Background(), func(ctx context.Context) { <-ctx.Done(); <-release }))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, r.Stop(ctx), context.DeadlineExceeded)
	close(release)
}
