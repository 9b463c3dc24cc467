package plan

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

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

// TestGiveUpRule checks the moves of a step given up: the steps before it
// are compensated in reverse order; a possibly-done step's own
// compensation comes first; a possibly-done step without one parks the
// saga; a compensation that cannot finish fails it.
func TestGiveUpRule(t *testing.T) {
	t.Parallel()
	def := orderDef(t)
	p := Planner{Subjects: wire.Subjects{Prefix: "t"}}
	id := uuid.Must(uuid.NewV7())
	at := func(state saga.State, version int64) *saga.Instance {
		return &saga.Instance{ID: id, Definition: "order", State: state, Version: version, Input: json.RawMessage(`{}`)}
	}
	next := func(t *testing.T, m *store.Move) (string, saga.Phase, wire.Command) {
		t.Helper()
		require.NotNil(t, m.Next)
		cmd, err := wire.DecodeCommand(m.Next.Payload)
		require.NoError(t, err)
		require.Equal(t, m.Next.Step, cmd.Step)
		require.Equal(t, m.To, cmd.State, "the next command carries the state the move leaves")
		require.Equal(t, m.Version+1, cmd.Version, "and the version")
		return m.Next.Step, m.Next.Phase, cmd
	}

	t.Run("charge refused: reserve is compensated", func(t *testing.T) {
		m, err := p.Failure(at("reserved", 4), def, 1, saga.PhaseForward, 2, "declined", compensation.NotDone)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensating, m.To)
		require.False(t, m.PossiblyDone)
		step, phase, _ := next(t, m)
		require.Equal(t, "reserve", step)
		require.Equal(t, saga.PhaseCompensate, phase)
	})
	t.Run("charge possibly done: its refund comes first", func(t *testing.T) {
		m, err := p.Failure(at("reserved", 4), def, 1, saga.PhaseForward, 5, "timeout", compensation.PossiblyDone)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensating, m.To)
		require.True(t, m.PossiblyDone)
		require.Contains(t, m.Error, saga.StepKey(id, "charge", saga.PhaseForward).String(), "the error names the key to check")
		step, phase, _ := next(t, m)
		require.Equal(t, "charge", step)
		require.Equal(t, saga.PhaseCompensate, phase)
		// After the refund, reserve.
		done, err := p.Success(at(saga.StateCompensating, 5), def, 1, saga.PhaseCompensate, 1, nil)
		require.NoError(t, err)
		step, phase, _ = next(t, done)
		require.Equal(t, "reserve", step)
		require.Equal(t, saga.PhaseCompensate, phase)
	})
	t.Run("notify possibly done without a compensation: parked", func(t *testing.T) {
		m, err := p.Failure(at("charged", 6), def, 2, saga.PhaseForward, 5, "no reply", compensation.PossiblyDone)
		require.NoError(t, err)
		require.Equal(t, saga.StateParked, m.To)
		require.True(t, m.Finished)
		require.Equal(t, "parked", m.Outcome)
		require.Nil(t, m.Next, "nothing is compensated")
		require.Contains(t, m.Error, saga.StepKey(id, "notify", saga.PhaseForward).String())
		require.Contains(t, m.Error, "`retry ")
	})
	t.Run("notify refused: charge and reserve are compensated", func(t *testing.T) {
		m, err := p.Failure(at("charged", 6), def, 2, saga.PhaseForward, 1, "refused", compensation.NotDone)
		require.NoError(t, err)
		step, _, _ := next(t, m)
		require.Equal(t, "charge", step)
	})
	t.Run("first step fails: compensated at once", func(t *testing.T) {
		m, err := p.Failure(at(saga.StateInit, 1), def, 0, saga.PhaseForward, 1, "out of stock", compensation.NotDone)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, m.To)
		require.True(t, m.Finished)
		require.Nil(t, m.Next)
	})
	t.Run("a compensation that cannot finish: failed", func(t *testing.T) {
		m, err := p.Failure(at(saga.StateCompensating, 9), def, 1, saga.PhaseCompensate, 5, "refund refused", compensation.PossiblyDone)
		require.NoError(t, err)
		require.Equal(t, saga.StateFailed, m.To)
		require.True(t, m.Finished)
		require.Contains(t, m.Error, "may have taken effect")
	})
	t.Run("last compensation: compensated", func(t *testing.T) {
		m, err := p.Success(at(saga.StateCompensating, 9), def, 0, saga.PhaseCompensate, 1, nil)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, m.To)
		require.True(t, m.Finished)
	})
	t.Run("a success carries its result to the next command", func(t *testing.T) {
		m, err := p.Success(at("reserved", 4), def, 1, saga.PhaseForward, 1, json.RawMessage(`{"charge":"ch-1"}`))
		require.NoError(t, err)
		require.Equal(t, saga.State("charged"), m.To)
		_, _, cmd := next(t, m)
		require.JSONEq(t, `{"charge":"ch-1"}`, string(cmd.Results["charge"]))
	})
	t.Run("moves the state graph forbids are refused", func(t *testing.T) {
		_, err := p.Success(at(saga.StateInit, 1), def, 1, saga.PhaseForward, 1, nil)
		require.Error(t, err)
		_, err = p.Failure(at(saga.StateCompensating, 3), def, 1, saga.PhaseForward, 1, "x", compensation.NotDone)
		require.Error(t, err)
		_, err = p.Success(at("reserved", 3), def, 0, saga.PhaseCompensate, 1, nil)
		require.Error(t, err)
	})
}

// TestSuccessDecidesConditionsOnce checks that a step's success decides
// the conditions of the steps after it: skipped ones are recorded in the
// move, the saga reaches the last skipped one's state, the next command
// carries the skips, and a compensation passes them over.
func TestSuccessDecidesConditionsOnce(t *testing.T) {
	t.Parallel()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	digital := func(sc *saga.StepContext) bool {
		var in struct {
			Digital bool `json:"digital"`
		}
		return sc.DecodeInput(&in) == nil && !in.Digital
	}
	def, err := saga.New("order",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "pack", Reaches: "packed", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop, When: saga.Condition{Func: digital}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: noop, Compensate: noop, When: saga.Condition{Func: digital}},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: noop},
	)
	require.NoError(t, err)
	p := Planner{Subjects: wire.Subjects{Prefix: "t"}}
	id := uuid.Must(uuid.NewV7())

	sg := &saga.Instance{ID: id, Definition: "order", State: saga.StateInit, Version: 1, Input: json.RawMessage(`{"digital":true}`)}
	m, err := p.Success(sg, def, 0, saga.PhaseForward, 1, json.RawMessage(`{"n":1}`))
	require.NoError(t, err)
	require.Equal(t, saga.State("shipped"), m.To)
	require.Equal(t, []string{"pack", "ship"}, m.Skip)
	require.Equal(t, "notify", m.Next.Step)
	cmd, err := wire.DecodeCommand(m.Next.Payload)
	require.NoError(t, err)
	require.Equal(t, []string{"pack", "ship"}, cmd.Skipped)
	require.Equal(t, saga.State("shipped"), cmd.State)

	// notify fails for good: only reserve is compensated.
	after := &saga.Instance{ID: id, Definition: "order", State: "shipped", Version: 2, Input: sg.Input, Skipped: cmd.Skipped}
	m, err = p.Failure(after, def, 3, saga.PhaseForward, 1, "refused", compensation.NotDone)
	require.NoError(t, err)
	require.Equal(t, "reserve", m.Next.Step)
	require.Equal(t, saga.PhaseCompensate, m.Next.Phase)

	// A physical order runs every step.
	sg.Input = json.RawMessage(`{"digital":false}`)
	m, err = p.Success(sg, def, 0, saga.PhaseForward, 1, nil)
	require.NoError(t, err)
	require.Equal(t, saga.State("reserved"), m.To)
	require.Empty(t, m.Skip)
	require.Equal(t, "pack", m.Next.Step)

	// The last steps skipped: the saga finishes in its final state.
	last := &saga.Instance{ID: id, Definition: "order", State: "reserved", Version: 2, Input: json.RawMessage(`{"digital":true}`)}
	def2, err := saga.New("order2",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.DatabaseStep, Forward: noop},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: noop, When: saga.Condition{Func: digital}},
	)
	require.NoError(t, err)
	m, err = p.Success(last, def2, 1, saga.PhaseForward, 1, nil)
	require.NoError(t, err)
	require.True(t, m.Finished)
	require.Equal(t, def2.FinalState(), m.To)
	require.Equal(t, []string{"ship"}, m.Skip)
	require.Nil(t, m.Next)
}
