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

// bank is another system: charges by key, and answers lost as a script
// says (lose: the charge is made and the answer lost; fail: an unknown
// answer with no charge).
type bank struct {
	mu      sync.Mutex
	charged map[uuid.UUID]int
	refunds int
	script  func(attempt int) (charge, lose bool)
}

func (b *bank) definition(t *testing.T, verify bool) *saga.Definition {
	t.Helper()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	charge := saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Retry: saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: fastPolicy.InitialBackoff, MaxBackoff: fastPolicy.MaxBackoff, Timeout: fastPolicy.Timeout}, CompensateRetry: fastPolicy,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			charge, lose := b.script(sc.Attempt)
			b.mu.Lock()
			defer b.mu.Unlock()
			if charge {
				b.charged[sc.Key]++
			}
			if lose {
				return nil, errors.New("connection reset by peer")
			}
			return json.RawMessage(`{"charged":true}`), nil
		},
		Compensate: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			b.mu.Lock()
			defer b.mu.Unlock()
			b.refunds++
			delete(b.charged, sc.ForwardKey)
			return nil, nil
		}}
	if verify {
		charge.Verify = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			b.mu.Lock()
			defer b.mu.Unlock()
			if b.charged[sc.Key] > 0 {
				return json.RawMessage(`{"charged":true,"verified":true}`), nil
			}
			return nil, saga.NotApplied(errors.New("the bank has no charge under this key"))
		}
	}
	def, err := saga.New("verified",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop, Retry: fastPolicy},
		charge)
	require.NoError(t, err)
	return def
}

// TestVerifyDecidesAnUnknownOutcome: after an attempt whose answer was
// lost, the step's Verify asks the other system about the key, and its
// answer decides, recorded with the attempt: a charge made is a success at
// once, with no second call; a charge never made is not possibly done, so
// a step that runs out of attempts parks nothing, and its compensation
// only voids the key. Without Verify the same unknown outcomes make the
// step possibly done, refunded when given up.
func TestVerifyDecidesAnUnknownOutcome(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		verify  bool
		script  func(int) (bool, bool)
		state   saga.State
		calls   int
		refunds int
		answer  string
	}{
		{"charged, answer lost: done", true, func(int) (bool, bool) { return true, true }, "charged", 1, 0, "done"},
		// Not done: given up, the step is not possibly done, but its
		// compensation still runs once, to void the key against a charge
		// request still on its way (here it finds nothing to give back).
		{"never charged: not done, the key voided", true, func(int) (bool, bool) { return false, true }, saga.StateCompensated, 2, 1, "not_done"},
		{"never charged, no Verify: possibly done, refunded", false, func(int) (bool, bool) { return false, true }, saga.StateCompensated, 2, 1, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := &bank{charged: map[uuid.UUID]int{}, script: tc.script}
			calls := 0
			var mu sync.Mutex
			inner := tc.script
			b.script = func(n int) (bool, bool) { mu.Lock(); calls++; mu.Unlock(); return inner(n) }
			def := b.definition(t, tc.verify)
			reg := prometheus.NewRegistry()
			env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Registerer: reg})
			sg := env.Run(t, def, "v-1", nil)
			require.Equal(t, tc.state, sg.State, sg.Error)
			mu.Lock()
			require.Equal(t, tc.calls, calls, "calls to the bank")
			mu.Unlock()
			require.Equal(t, tc.refunds, b.refunds)
			var step saga.StepExecution
			for _, s := range sg.Steps {
				if s.Step == "charge" && s.Phase == saga.PhaseForward {
					step = s
				}
			}
			require.Equal(t, !tc.verify, step.PossiblyDone, "possibly done only when no one could tell")
			if tc.answer == "" {
				return
			}
			require.EqualValues(t, tc.calls, metricSum(t, reg, "idemsaga_verified_total", map[string]string{"answer": tc.answer}))
			var first saga.StepAttempt
			for _, a := range sg.Attempts {
				if a.Step == "charge" && a.Phase == saga.PhaseForward && a.Attempt == 1 {
					first = a
				}
			}
			require.Contains(t, first.Error, "Verify found the key", "the answer is recorded with the attempt")
			if tc.answer == "done" {
				require.Equal(t, "succeeded", first.Outcome)
				require.JSONEq(t, `{"charged":true,"verified":true}`, string(sg.Results["charge"]))
			}
		})
	}
}
