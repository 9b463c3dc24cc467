package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// till is another system for the takeover tests: charges by key; each
// attempt's call charges or not as charges says, and answers.
type till struct {
	mu      sync.Mutex
	calls   int
	charged map[uuid.UUID]int
	voided  map[uuid.UUID]bool
	charges func(attempt int) bool
}

func (l *till) definition(t *testing.T, verify, compensate bool) *saga.Definition {
	t.Helper()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	policy := fastPolicy
	policy.MaxAttempts = 2
	charge := saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Retry: policy, CompensateRetry: fastPolicy,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.calls++
			if l.voided[sc.Key] {
				return nil, saga.Permanent(errors.New("key voided"))
			}
			if l.charges(sc.Attempt) {
				l.charged[sc.Key]++
				return json.RawMessage(`{"charged":true}`), nil
			}
			return nil, saga.NotApplied(errors.New("declined for now: nothing charged"))
		}}
	if compensate {
		charge.Compensate = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			l.mu.Lock()
			defer l.mu.Unlock()
			delete(l.charged, sc.ForwardKey)
			l.voided[sc.ForwardKey] = true
			return nil, nil
		}
	}
	if verify {
		charge.Verify = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.charged[sc.Key] > 0 {
				return json.RawMessage(`{"charged":true,"verified":true}`), nil
			}
			return nil, saga.NotApplied(errors.New("no charge under this key"))
		}
	}
	def, err := saga.New("tilled",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop, Retry: fastPolicy},
		charge)
	require.NoError(t, err)
	return def
}

func attemptOf(sg *saga.Instance, step string, n int) saga.StepAttempt {
	for _, a := range sg.Attempts {
		if a.Step == step && a.Phase == saga.PhaseForward && a.Attempt == n {
			return a
		}
	}
	return saga.StepAttempt{}
}

// TestVerifyAfterTheLastAttemptsWorkerDied: the worker of a step's last
// attempt dies during its call, so the attempt's outcome is unknown and
// only its lease runs out. Before the step is given up, one more attempt
// asks its Verify, and calls nothing: a charge made is the step's
// success; none made gives the step up as not done: a compensation voids
// the key, and a step without one does not park. Without Verify the same
// step parks.
func TestVerifyAfterTheLastAttemptsWorkerDied(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name                string
		verify, compensate  bool
		charged             bool
		state               saga.State
		calls, voids, verif int
	}{
		{"charged: Verify finds it done", true, true, true, "charged", 2, 0, 1},
		{"not charged: Verify finds it not done, the key voided", true, true, false, saga.StateCompensated, 2, 1, 1},
		{"not charged, no compensation: not done, no park", true, false, false, saga.StateCompensated, 2, 0, 1},
		{"not charged, no compensation, no Verify: parked", false, false, false, saga.StateParked, 2, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l := &till{charged: map[uuid.UUID]int{}, voided: map[uuid.UUID]bool{},
				charges: func(attempt int) bool { return attempt == 2 && tc.charged }}
			def := l.definition(t, tc.verify, tc.compensate)
			reg := prometheus.NewRegistry()
			env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Registerer: reg})
			// The last attempt's call returns, and its worker dies before
			// it records what the call did.
			env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 2})
			sg := env.Run(t, def, "t-1", nil)
			require.Equal(t, tc.state, sg.State, sg.Error)
			require.Equal(t, 1, env.Fired(sagatest.LoseOutcome))

			l.mu.Lock()
			defer l.mu.Unlock()
			require.Equal(t, tc.calls, l.calls, "the attempt after the last calls nothing")
			require.Equal(t, tc.voids, len(l.voided))
			if tc.charged {
				require.Equal(t, 1, l.charged[saga.StepKey(sg.ID, "charge", saga.PhaseForward)], "charged once")
			}
			require.EqualValues(t, tc.verif, metricSum(t, reg, "idemsaga_verified_total", nil))
			if !tc.verify {
				return
			}
			third := attemptOf(sg, "charge", 3)
			require.Contains(t, third.Error, "attempt 2's outcome is unknown", "the Verify attempt says why it asked")
			if tc.charged {
				require.Equal(t, "succeeded", third.Outcome)
				require.JSONEq(t, `{"charged":true,"verified":true}`, string(sg.Results["charge"]))
			}
			for _, s := range sg.Steps {
				if s.Step == "charge" && s.Phase == saga.PhaseForward {
					require.False(t, s.PossiblyDone, "Verify answered about the key")
				}
			}
		})
	}
}

// TestVerifyBeforeCallingAgain: an attempt whose worker died during its
// call leaves its outcome unknown; the next attempt asks the step's
// Verify before it calls, and a charge found is the step's success with
// no second call.
func TestVerifyBeforeCallingAgain(t *testing.T) {
	t.Parallel()
	l := &till{charged: map[uuid.UUID]int{}, voided: map[uuid.UUID]bool{}, charges: func(int) bool { return true }}
	def := l.definition(t, true, true)
	reg := prometheus.NewRegistry()
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Registerer: reg})
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 1})
	sg := env.Run(t, def, "t-2", nil)
	require.Equal(t, saga.State("charged"), sg.State, sg.Error)
	l.mu.Lock()
	require.Equal(t, 1, l.calls, "the second attempt asked and did not call")
	l.mu.Unlock()
	require.EqualValues(t, 1, metricSum(t, reg, "idemsaga_verified_total", map[string]string{"answer": "done"}))
	require.Contains(t, attemptOf(sg, "charge", 2).Error, "Verify found the key took effect")
}
