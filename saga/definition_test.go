package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// noop is a forward or compensate handler that does nothing.
func noop(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }

// step returns a valid step named name that reaches state reaches.
func step(name string, reaches saga.State) saga.Step {
	return saga.Step{Name: name, Reaches: reaches, Kind: saga.DatabaseStep, Forward: noop}
}

func TestNewRejectsInvalidDefinitions(t *testing.T) {
	t.Parallel()

	withRetry := func(p saga.RetryPolicy) saga.Step {
		s := step("a", "a_done")
		s.Retry = p
		return s
	}
	withCompensateRetry := func(p saga.RetryPolicy) saga.Step {
		s := step("a", "a_done")
		s.Compensate = noop
		s.CompensateRetry = p
		return s
	}

	tests := []struct {
		name  string
		def   string
		steps []saga.Step
		field string
	}{
		{"empty name", "", []saga.Step{step("a", "a_done")}, "name"},
		{"name with space", "my saga", []saga.Step{step("a", "a_done")}, "name"},
		{"name with dot", "my.saga", []saga.Step{step("a", "a_done")}, "name"},
		{"name too long", strings.Repeat("x", 65), []saga.Step{step("a", "a_done")}, "name"},
		{"no steps", "s", nil, "steps"},
		{"empty step name", "s", []saga.Step{step("", "a_done")}, "steps[0].Name"},
		{"step name with slash", "s", []saga.Step{step("a/b", "a_done")}, "steps[0].Name"},
		{"step name with NUL", "s", []saga.Step{step("a\x00b", "a_done")}, "steps[0].Name"},
		{"step name too long", "s", []saga.Step{step(strings.Repeat("x", 65), "a_done")}, "steps[0].Name"},
		{"duplicate step name", "s", []saga.Step{step("a", "a_done"), step("a", "b_done")}, "steps[1].Name"},
		{"empty Reaches", "s", []saga.Step{step("a", "")}, "steps[0].Reaches"},
		{"Reaches with space", "s", []saga.Step{step("a", "a done")}, "steps[0].Reaches"},
		{"Reaches init", "s", []saga.Step{step("a", saga.StateInit)}, "steps[0].Reaches"},
		{"Reaches compensating", "s", []saga.Step{step("a", saga.StateCompensating)}, "steps[0].Reaches"},
		{"Reaches compensated", "s", []saga.Step{step("a", saga.StateCompensated)}, "steps[0].Reaches"},
		{"Reaches failed", "s", []saga.Step{step("a", saga.StateFailed)}, "steps[0].Reaches"},
		{"duplicate Reaches", "s", []saga.Step{step("a", "done"), step("b", "x"), step("c", "done")}, "steps[2].Reaches"},
		{"Reaches parked", "s", []saga.Step{step("a", saga.StateParked)}, "steps[0].Reaches"},
		{"Reaches closed", "s", []saga.Step{step("a", saga.StateClosed)}, "steps[0].Reaches"},
		{"nil Forward", "s", []saga.Step{step("a", "a_done"), {Name: "b", Reaches: "b_done", Kind: saga.DatabaseStep}}, "steps[1].Forward"},
		{"no Kind", "s", []saga.Step{step("a", "a_done"), {Name: "b", Reaches: "b_done", Forward: noop}}, "steps[1].Kind"},
		{"unknown Kind", "s", []saga.Step{{Name: "b", Reaches: "b_done", Forward: noop, Kind: saga.StepKind(7)}}, "steps[0].Kind"},
		{"negative MaxAttempts", "s", []saga.Step{withRetry(saga.RetryPolicy{MaxAttempts: -1})}, "steps[0].Retry"},
		{"negative InitialBackoff", "s", []saga.Step{withRetry(saga.RetryPolicy{InitialBackoff: -time.Second})}, "steps[0].Retry"},
		{"negative MaxBackoff", "s", []saga.Step{withRetry(saga.RetryPolicy{MaxBackoff: -time.Second})}, "steps[0].Retry"},
		{"InitialBackoff above MaxBackoff", "s", []saga.Step{withRetry(saga.RetryPolicy{InitialBackoff: 2 * time.Second, MaxBackoff: time.Second})}, "steps[0].Retry"},
		{"Multiplier below 1", "s", []saga.Step{withRetry(saga.RetryPolicy{Multiplier: 0.5})}, "steps[0].Retry"},
		{"negative Multiplier", "s", []saga.Step{withRetry(saga.RetryPolicy{Multiplier: -2})}, "steps[0].Retry"},
		{"Jitter above 1", "s", []saga.Step{withRetry(saga.RetryPolicy{Jitter: 1.5})}, "steps[0].Retry"},
		{"negative Timeout", "s", []saga.Step{withRetry(saga.RetryPolicy{Timeout: -time.Second})}, "steps[0].Retry"},
		{"bad CompensateRetry", "s", []saga.Step{withCompensateRetry(saga.RetryPolicy{MaxAttempts: -3})}, "steps[0].CompensateRetry"},
		{"bad Retry of second step", "s", []saga.Step{step("z", "z_done"), withRetry(saga.RetryPolicy{Jitter: 2})}, "steps[1].Retry"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			def, err := saga.New(tt.def, tt.steps...)
			require.Nil(t, def)
			require.Error(t, err)
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)

			var de *saga.DefinitionError
			require.True(t, errors.As(err, &de), "want *saga.DefinitionError, got %T", err)
			require.Equal(t, tt.field, de.Field)
			require.Equal(t, tt.def, de.Definition)
			require.NotEmpty(t, de.Problem)
			require.Contains(t, err.Error(), tt.field)

			require.Panics(t, func() { saga.MustNew(tt.def, tt.steps...) })
		})
	}
}

func TestNewAcceptsValidDefinition(t *testing.T) {
	t.Parallel()

	reserve := step("reserve", "reserved")
	reserve.Compensate = noop
	charge := step("charge", "charged")
	charge.Kind = saga.ExternalStep
	charge.Retry = saga.RetryPolicy{MaxAttempts: 3, Jitter: -1}
	ship := step("ship-2", "Shipped_OK")
	ship.Retry = saga.RetryPolicy{Multiplier: 1, Jitter: 1, InitialBackoff: time.Second, MaxBackoff: time.Second}
	input := []saga.Step{reserve, charge, ship}

	def, err := saga.New("order_flow-1", input...)
	require.NoError(t, err)
	require.NotPanics(t, func() { saga.MustNew("order_flow-1", input...) })

	require.Equal(t, "order_flow-1", def.Name())
	require.Equal(t, 3, def.Len())
	require.Equal(t, saga.State("Shipped_OK"), def.FinalState())
	require.Equal(t, 0, def.StepIndex("reserve"))
	require.Equal(t, 2, def.StepIndex("ship-2"))
	require.Equal(t, -1, def.StepIndex("missing"))
	require.Equal(t, saga.StateInit, def.StateBefore(0))
	require.Equal(t, saga.State("reserved"), def.StateBefore(1))
	require.Equal(t, saga.State("charged"), def.StateBefore(2))
	require.NotNil(t, def.Step(0).Compensate)
	require.Nil(t, def.Step(1).Compensate)
	require.Equal(t, saga.DatabaseStep, def.Step(0).Kind)
	require.Equal(t, saga.ExternalStep, def.Step(1).Kind)

	// Zero fields take the defaults, in both policies.
	defaults := saga.RetryPolicy{
		MaxAttempts:    saga.MaxAttemptsDefault,
		InitialBackoff: saga.InitialBackoffDefault,
		MaxBackoff:     saga.MaxBackoffDefault,
		Multiplier:     saga.MultiplierDefault,
		Jitter:         saga.JitterDefault,
		Timeout:        saga.TimeoutDefault,
	}
	require.Equal(t, defaults, def.Step(0).Retry)
	require.Equal(t, defaults, def.Step(0).CompensateRetry)
	require.Equal(t, saga.MaxAttemptsDefault, def.Step(0).Retry.MaxAttempts)

	// Set fields are kept; a negative Jitter means none.
	got := def.Step(1).Retry
	require.Equal(t, 3, got.MaxAttempts)
	require.Negative(t, got.Jitter)
	require.Equal(t, got.Backoff(1), got.Backoff(1), "no jitter: the same delay every time")
	require.Equal(t, saga.InitialBackoffDefault, got.InitialBackoff)
	got = def.Step(2).Retry
	require.Equal(t, 1.0, got.Multiplier)
	require.Equal(t, 1.0, got.Jitter)
	require.Equal(t, time.Second, got.InitialBackoff)
	require.Equal(t, time.Second, got.MaxBackoff)

	// The caller's steps are not modified, and Steps returns a copy.
	require.Equal(t, saga.RetryPolicy{}, input[0].Retry)
	steps := def.Steps()
	require.Len(t, steps, 3)
	steps[0].Name = "changed"
	require.Equal(t, "reserve", def.Step(0).Name)
}

func TestValidStateAndIsTerminal(t *testing.T) {
	t.Parallel()
	def := saga.MustNew("s", step("a", "a_done"), step("b", "b_done"))

	for _, s := range []saga.State{saga.StateInit, saga.StateCompensating, saga.StateCompensated, saga.StateFailed, saga.StateParked, saga.StateClosed, "a_done", "b_done"} {
		require.True(t, def.ValidState(s), s)
	}
	for _, s := range []saga.State{"", "a", "unknown", "A_DONE"} {
		require.False(t, def.ValidState(s), s)
	}

	for _, s := range []saga.State{"b_done", saga.StateCompensated, saga.StateFailed, saga.StateParked, saga.StateClosed} {
		require.True(t, def.IsTerminal(s), s)
	}
	for _, s := range []saga.State{saga.StateInit, saga.StateCompensating, "a_done"} {
		require.False(t, def.IsTerminal(s), s)
	}
}

func TestStepKindString(t *testing.T) {
	t.Parallel()
	require.Equal(t, "database", saga.DatabaseStep.String())
	require.Equal(t, "external", saga.ExternalStep.String())
	require.Equal(t, "child", saga.ChildStep.String())
	require.Equal(t, "StepKind(0)", saga.StepKind(0).String())
}

// TestWithVersion: a definition is version 1 unless set; a versioned copy
// keeps its steps, describes its version (so two versions fingerprint
// differently), survives a description round trip, and composes with
// WithInput. A version below 1 panics, as MustNew does.
func TestWithVersion(t *testing.T) {
	t.Parallel()
	base := saga.MustNew("order", step("pay", "paid"))
	require.Equal(t, 1, base.Version())
	require.Equal(t, "order@1", base.Ref())
	v3 := saga.WithVersion(base, 3)
	require.Equal(t, 3, v3.Version())
	require.Equal(t, 1, base.Version(), "the original is unchanged")
	require.Equal(t, "order@3", v3.Ref())
	require.Equal(t, base.Steps()[0].Name, v3.Steps()[0].Name)
	require.NotEqual(t, base.Describe().Fingerprint(), v3.Describe().Fingerprint())
	require.Equal(t, 3, v3.Describe().Version)

	rebuilt, err := saga.FromDescription(v3.Describe())
	require.NoError(t, err)
	require.Equal(t, 3, rebuilt.Version())
	old := v3.Describe()
	old.Version = 0 // recorded before versions existed
	rebuilt, err = saga.FromDescription(old)
	require.NoError(t, err)
	require.Equal(t, 1, rebuilt.Version())
	old.Version = -1
	_, err = saga.FromDescription(old)
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)

	type in struct{ N int }
	typed := saga.WithInput(v3, func(in) error { return nil })
	require.Equal(t, 3, typed.Version())
	require.Equal(t, 3, saga.WithVersion(saga.WithInput(base, func(in) error { return nil }), 3).Version())

	require.Equal(t, "order@1", saga.Ref("order", 0))
	require.PanicsWithError(t, `idemsaga: invalid saga definition "order": version: is 0; versions start at 1`, func() { saga.WithVersion(base, 0) })
}
