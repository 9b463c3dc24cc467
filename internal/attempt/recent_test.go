package attempt_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestDeliveriesOfARunningAttemptWaitInMemory: while one delivery of an
// attempt runs its handler, more deliveries of it to the same worker wait
// for that run in memory, then answer with its outcome, without the
// database. A run that fails retryably ends the attempt as well: the
// waiters answer with that retry, and none runs the handler again.
func TestDeliveriesOfARunningAttemptWaitInMemory(t *testing.T) {
	t.Parallel()
	for _, fail := range []bool{false, true} {
		name := "the run succeeds"
		if fail {
			name = "the run fails, retryably"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			entered, release := make(chan struct{}), make(chan struct{})
			var runs atomic.Int32
			def := saga.MustNew("slow", saga.Step{
				Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
				Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
					if runs.Add(1) == 1 {
						close(entered)
						<-release
						if fail {
							return nil, errors.New("not yet")
						}
					}
					return json.RawMessage(`"ok"`), nil
				},
			})
			w, m := newRunner(t, pool, 16, def)
			cmd := testenv.Command(testenv.NewSaga(t, pool, "slow"), "slow", "s", saga.PhaseForward, 1, nil)

			const n = 6
			replies := make([]wire.Reply, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			wg.Go(func() { replies[0], errs[0] = w.Handle(ctx, cmd, false) })
			<-entered
			for i := 1; i < n; i++ {
				wg.Go(func() { replies[i], errs[i] = w.Handle(ctx, cmd, false) })
			}
			// Every other delivery waits in memory for the run that holds
			// the key before it ends. One that went to the database instead
			// would wait on the key there, never counted here.
			require.Eventually(t, func() bool { return w.Waiting() == n-1 }, 30*time.Second, time.Millisecond)
			close(release)
			wg.Wait()

			fresh := 0
			for i := range n {
				require.NoError(t, errs[i])
				if !replies[i].Duplicate {
					fresh++
				}
			}
			recent := counter(t, m.Duplicates.WithLabelValues(metrics.LayerRecent))
			inbox := counter(t, m.Duplicates.WithLabelValues(metrics.LayerInbox))
			want := wire.OutcomeSucceeded
			if fail {
				want = wire.OutcomeRetry
			}
			require.Equal(t, 1, fresh, "one delivery ran the handler")
			require.Equal(t, int32(1), runs.Load())
			for i := range n {
				require.Equal(t, want, replies[i].Outcome)
			}
			require.Equal(t, float64(n-1), recent+inbox, "every other delivery is a duplicate")
			require.Equal(t, float64(n-1), recent, "answered from memory, after waiting for the run")
		})
	}
}

// TestWaitForARunningAttemptIsBounded: a delivery waiting for a run of its
// attempt that hangs gives up after the attempt's timeout, with an error
// (the command is delivered again later), instead of holding a slot of
// the worker for as long as the run hangs.
func TestWaitForARunningAttemptIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	def := saga.MustNew("hung", saga.Step{
		Name: "s", Reaches: "done", Kind: saga.DatabaseStep, Retry: saga.RetryPolicy{Timeout: 200 * time.Millisecond},
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			once.Do(func() { close(entered) })
			<-release // ignores its context, as a stuck call would
			return nil, nil
		},
	})
	w, _ := newRunner(t, pool, 16, def)
	cmd := testenv.Command(testenv.NewSaga(t, pool, "hung"), "hung", "s", saga.PhaseForward, 1, nil)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(release)
	wg.Go(func() { _, _ = w.Handle(ctx, cmd, false) })
	<-entered
	_, err := w.Handle(ctx, cmd, false)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "still running in this worker")
}
