package failpoint

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The tests share package state, so they do not run in parallel.

func TestInertWhenOff(t *testing.T) {
	Disable()
	for _, n := range Names {
		require.NoError(t, Inject(n))
	}
}

func TestActions(t *testing.T) {
	defer Disable()
	require.NoError(t, Enable("step-after-inbox=error*2; relay-before-mark=sleep(20ms)"))
	require.ErrorIs(t, Inject(StepAfterInbox), ErrInjected)
	require.ErrorIs(t, Inject(StepAfterInbox), ErrInjected)
	require.NoError(t, Inject(StepAfterInbox), "fires only twice")
	require.EqualValues(t, 2, Hits(StepAfterInbox))
	start := time.Now()
	require.NoError(t, Inject(RelayBeforeMark))
	require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond)
	require.NoError(t, Inject(StepBeforeAck), "points not named stay inert")

	require.NoError(t, Enable("lease-takeover=panic"))
	require.Panics(t, func() { _ = Inject(LeaseTakeover) })
	require.NoError(t, Inject(StepAfterInbox), "Enable replaces the earlier set")
}

func TestExitAction(t *testing.T) {
	defer Disable()
	var code int
	exit = func(c int) { code = c }
	defer func() { exit = osExit }()
	require.NoError(t, Enable("start-after-commit=exit"))
	require.NoError(t, Inject(StartAfterCommit))
	require.Equal(t, ExitCode, code)
}

func TestCountIsExactUnderConcurrency(t *testing.T) {
	defer Disable()
	require.NoError(t, Enable("step-before-ack=error*25"))
	var wg sync.WaitGroup
	var mu sync.Mutex
	fired := 0
	for range 100 {
		wg.Go(func() {
			if errors.Is(Inject(StepBeforeAck), ErrInjected) {
				mu.Lock()
				fired++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, 25, fired)
}

func TestProbability(t *testing.T) {
	defer Disable()
	require.NoError(t, Enable("step-before-ack=error@0.5"))
	fired := 0
	for range 2000 {
		if Inject(StepBeforeAck) != nil {
			fired++
		}
	}
	require.InDelta(t, 1000, fired, 150)
}

func TestBadSpecsChangeNothing(t *testing.T) {
	defer Disable()
	require.NoError(t, Enable("step-before-ack=error"))
	for _, spec := range []string{
		"nope=exit", "step-before-ack", "step-before-ack=", "step-before-ack=explode",
		"step-before-ack=error*0", "step-before-ack=error@2", "step-before-ack=sleep(x)",
	} {
		require.Error(t, Enable(spec), spec)
	}
	require.ErrorIs(t, Inject(StepBeforeAck), ErrInjected, "a rejected spec leaves the earlier one in force")
}
