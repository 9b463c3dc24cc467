package orchestrate

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

func TestJudge(t *testing.T) {
	t.Parallel()
	r := func(attempt int) wire.Reply { return wire.Reply{Attempt: attempt} }
	cases := []struct {
		name  string
		row   stepRow
		reply wire.Reply
		want  Verdict
	}{
		{"current attempt in flight", stepRow{status: saga.StepDispatched, attempt: 2}, r(2), VerdictApplied},
		{"older attempt", stepRow{status: saga.StepDispatched, attempt: 2}, r(1), VerdictStale},
		{"older attempt after success", stepRow{status: saga.StepSucceeded, attempt: 3}, r(1), VerdictStale},
		{"attempt never dispatched", stepRow{status: saga.StepDispatched, attempt: 1}, r(2), VerdictStale},
		{"already succeeded", stepRow{status: saga.StepSucceeded, attempt: 1}, r(1), VerdictDuplicate},
		{"already failed", stepRow{status: saga.StepFailed, attempt: 1}, r(1), VerdictDuplicate},
		{"retry already scheduled", stepRow{status: saga.StepRetrying, attempt: 1}, r(1), VerdictDuplicate},
		{"success after a retry was scheduled", stepRow{status: saga.StepRetrying, attempt: 1}, wire.Reply{Attempt: 1, Outcome: wire.OutcomeSucceeded}, VerdictApplied},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, judge(tc.row, tc.reply))
		})
	}
}

// orderDef is reserve (database, compensable) → charge (external,
// compensable) → notify (external, not compensable) → ship (database).
func orderDef(t *testing.T) *saga.Definition {
	t.Helper()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def, err := saga.New("order",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: noop},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Forward: noop},
	)
	require.NoError(t, err)
	return def
}

func testCore(t *testing.T, def *saga.Definition) *Core {
	t.Helper()
	m, err := metrics.New(nil)
	require.NoError(t, err)
	return New(Config{Definitions: []*saga.Definition{def}, SubjectPrefix: "t", Metrics: m, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
}

// TestInStepMoves checks what the engine applies in a step's own
// transaction and what it leaves to the orchestrator.
func TestInStepMoves(t *testing.T) {
	t.Parallel()
	def := orderDef(t)
	c := testCore(t, def)
	id := uuid.Must(uuid.NewV7())
	cmd := func(step string, phase saga.Phase, attemptNo int, state saga.State, version int64) wire.Command {
		return wire.Command{SagaID: id, Definition: "order", Step: step, Phase: phase, Key: saga.StepKey(id, step, phase),
			Attempt: attemptNo, Input: json.RawMessage(`{}`), State: state, Version: version}
	}
	ok := func(m store.Move, ok bool) store.Move { require.True(t, ok); return m }
	no := func(_ store.Move, ok bool) { require.False(t, ok) }

	m := ok(c.Move(cmd("reserve", saga.PhaseForward, 1, saga.StateInit, 1), saga.DatabaseStep, attempt.Outcome{Status: wire.OutcomeSucceeded}))
	require.Equal(t, saga.State("reserved"), m.To)
	require.False(t, m.RecordFailure)

	m = ok(c.Move(cmd("reserve", saga.PhaseForward, 1, saga.StateInit, 1), saga.DatabaseStep, attempt.Outcome{Status: wire.OutcomeFailed, Error: "no stock"}))
	require.Equal(t, saga.StateCompensated, m.To)
	require.True(t, m.RecordFailure, "a database step's failure is recorded with its move")

	m = ok(c.Move(cmd("ship", saga.PhaseForward, 5, "notified", 9), saga.DatabaseStep, attempt.Outcome{Status: wire.OutcomeRetry, Error: "deadlock"}))
	require.Contains(t, m.StepError, "5 attempts exhausted")
	require.Equal(t, saga.StateCompensating, m.To)

	no(c.Move(cmd("ship", saga.PhaseForward, 2, "notified", 9), saga.DatabaseStep, attempt.Outcome{Status: wire.OutcomeRetry}))
	no(c.Move(cmd("charge", saga.PhaseForward, 1, "reserved", 3), saga.ExternalStep, attempt.Outcome{Status: wire.OutcomeFailed}))
	no(c.Move(cmd("charge", saga.PhaseForward, 5, "reserved", 3), saga.ExternalStep, attempt.Outcome{Status: wire.OutcomeUnknown}))
	no(c.Move(cmd("reserve", saga.PhaseForward, 1, saga.StateInit, 0), saga.DatabaseStep, attempt.Outcome{Status: wire.OutcomeSucceeded}))
	ok(c.Move(cmd("charge", saga.PhaseForward, 3, "reserved", 3), saga.ExternalStep, attempt.Outcome{Status: wire.OutcomeSucceeded}))
	no(c.Move(cmd("charge", saga.PhaseForward, 1, saga.StateInit, 3), saga.ExternalStep, attempt.Outcome{Status: wire.OutcomeSucceeded}))
}
