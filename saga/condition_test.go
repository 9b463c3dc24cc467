package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func conditionNoop(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }

// physical decides from the input and the reserve step's result.
func physical(sc *saga.StepContext) bool {
	var in struct {
		Digital bool `json:"digital"`
	}
	if err := sc.DecodeInput(&in); err != nil {
		return true
	}
	var r struct {
		Warehouse string `json:"warehouse"`
	}
	ok, err := sc.DecodeResult("reserve", &r)
	return !in.Digital && ok && err == nil && r.Warehouse != ""
}

func conditionalOrder(t *testing.T) *saga.Definition {
	t.Helper()
	def, err := saga.New("order",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: conditionNoop, Compensate: conditionNoop},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Forward: conditionNoop, Compensate: conditionNoop,
			When: saga.Condition{Reads: []string{"reserve"}, Func: physical}},
		saga.Step{Name: "gift", Reaches: "gifted", Kind: saga.DatabaseStep, Forward: conditionNoop,
			When: saga.Condition{Func: func(*saga.StepContext) bool { return false }}},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: conditionNoop},
	)
	require.NoError(t, err)
	return def
}

func TestConditionRefusedWhenBuilt(t *testing.T) {
	t.Parallel()
	step := func(name string, reaches saga.State, when saga.Condition) saga.Step {
		return saga.Step{Name: name, Reaches: reaches, Kind: saga.DatabaseStep, Forward: conditionNoop, When: when}
	}
	yes := func(*saga.StepContext) bool { return true }
	tests := []struct {
		name  string
		steps []saga.Step
		field string
		says  string
	}{
		{"on the first step", []saga.Step{step("a", "x", saga.Condition{Func: yes}), step("b", "y", saga.Condition{})}, "steps[0].When", "first step"},
		{"without Func", []saga.Step{step("a", "x", saga.Condition{}), step("b", "y", saga.Condition{Reads: []string{"a"}})}, "steps[1].When", "without its Func"},
		{"reads a later result", []saga.Step{step("a", "x", saga.Condition{}), step("b", "y", saga.Condition{Reads: []string{"c"}, Func: yes}), step("c", "z", saga.Condition{})}, "steps[1].When", "does not come before it"},
		{"reads its own result", []saga.Step{step("a", "x", saga.Condition{}), step("b", "y", saga.Condition{Reads: []string{"b"}, Func: yes})}, "steps[1].When", "does not come before it"},
		{"reads a step that does not exist", []saga.Step{step("a", "x", saga.Condition{}), step("b", "y", saga.Condition{Reads: []string{"nope"}, Func: yes})}, "steps[1].When", "does not have"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := saga.New("d", tt.steps...)
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			var de *saga.DefinitionError
			require.True(t, errors.As(err, &de))
			require.Equal(t, tt.field, de.Field)
			require.Contains(t, err.Error(), tt.says)
		})
	}
}

func TestRunsDecidesFromInputAndDeclaredResults(t *testing.T) {
	t.Parallel()
	def := conditionalOrder(t)
	id := uuid.Must(uuid.NewV7())
	reserved := map[string]json.RawMessage{"reserve": json.RawMessage(`{"warehouse":"w1"}`)}

	runs, err := def.Runs(0, id, json.RawMessage(`{}`), nil)
	require.NoError(t, err)
	require.True(t, runs, "a step without a condition runs")

	runs, err = def.Runs(1, id, json.RawMessage(`{"digital":false}`), reserved)
	require.NoError(t, err)
	require.True(t, runs)
	runs, err = def.Runs(1, id, json.RawMessage(`{"digital":true}`), reserved)
	require.NoError(t, err)
	require.False(t, runs)

	// The condition sees only the results it declared.
	var saw map[string]json.RawMessage
	spy, err := saga.New("spy",
		saga.Step{Name: "a", Reaches: "x", Kind: saga.DatabaseStep, Forward: conditionNoop},
		saga.Step{Name: "b", Reaches: "y", Kind: saga.DatabaseStep, Forward: conditionNoop},
		saga.Step{Name: "c", Reaches: "z", Kind: saga.DatabaseStep, Forward: conditionNoop,
			When: saga.Condition{Reads: []string{"b"}, Func: func(sc *saga.StepContext) bool { saw = sc.Results; return true }}},
	)
	require.NoError(t, err)
	_, err = spy.Runs(2, id, json.RawMessage(`{}`), map[string]json.RawMessage{"a": json.RawMessage(`1`), "b": json.RawMessage(`2`)})
	require.NoError(t, err)
	require.Equal(t, map[string]json.RawMessage{"b": json.RawMessage(`2`)}, saw)

	// A definition rebuilt from its description cannot decide.
	described, err := saga.FromDescription(def.Describe())
	require.NoError(t, err)
	require.Equal(t, def.Describe().Fingerprint(), described.Describe().Fingerprint())
	_, err = described.Runs(1, id, json.RawMessage(`{}`), reserved)
	require.ErrorIs(t, err, saga.ErrConditionElsewhere)
	runs, err = described.Runs(3, id, json.RawMessage(`{}`), reserved)
	require.NoError(t, err)
	require.True(t, runs)
}

func TestCanTransitionPastConditionalSteps(t *testing.T) {
	t.Parallel()
	def := conditionalOrder(t)
	// A step's success reaches its state, or the state of the last of
	// the conditional steps right after it that it skipped.
	require.True(t, def.CanTransition("init", "reserved"))
	require.True(t, def.CanTransition("init", "shipped"), "reserve's success, ship skipped")
	require.True(t, def.CanTransition("init", "gifted"), "reserve's success, ship and gift skipped")
	require.False(t, def.CanTransition("init", "notified"), "notify has no condition: only its own success reaches its state")
	require.True(t, def.CanTransition("reserved", "shipped"))
	require.True(t, def.CanTransition("reserved", "gifted"), "ship's success, gift skipped")
	require.False(t, def.CanTransition("reserved", "notified"))
	require.True(t, def.CanTransition("gifted", "notified"))
	require.False(t, def.CanTransition("notified", "shipped"), "never backwards")
	require.False(t, def.CanTransition("shipped", "reserved"), "never backwards")
}
