package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// TestLimitIsChecked: a step's Limit is checked when the definition is
// built: each mistake is refused with an error that names the field and
// what to change, and a valid one gets its defaults.
func TestLimitIsChecked(t *testing.T) {
	t.Parallel()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	key := func(*saga.StepContext) string { return "t" }
	build := func(kind saga.StepKind, l saga.Limit) (*saga.Definition, error) {
		return saga.New("pay", saga.Step{Name: "charge", Reaches: "charged", Kind: kind, Forward: noop, Limit: l})
	}
	for _, tc := range []struct {
		name  string
		kind  saga.StepKind
		limit saga.Limit
		want  string
	}{
		{"database step", saga.DatabaseStep, saga.Limit{Concurrency: 2}, "database step"},
		{"negative", saga.ExternalStep, saga.Limit{Concurrency: -1}, "must not be negative"},
		{"per without rate", saga.ExternalStep, saga.Limit{Concurrency: 1, Per: time.Second}, "give Rate too"},
		{"per key without its function", saga.ExternalStep, saga.Limit{PerKey: 2}, "PerKey needs KeyFunc"},
		{"key function without per key", saga.ExternalStep, saga.Limit{Concurrency: 2, KeyFunc: key}, "give PerKey too"},
		{"a name alone", saga.ExternalStep, saga.Limit{Name: "psp"}, "bounds nothing"},
		{"a bad name", saga.CallbackStep, saga.Limit{Name: "psp account", Rate: 5}, "letters, digits"},
		{"too fast", saga.ExternalStep, saga.Limit{Rate: 2_000_000, Per: time.Second}, "less than a microsecond"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := build(tc.kind, tc.limit)
			require.True(t, errors.Is(err, saga.ErrInvalidDefinition), "got %v", err)
			require.ErrorContains(t, err, "steps[0].Limit")
			require.ErrorContains(t, err, tc.want)
		})
	}
	d, err := build(saga.ExternalStep, saga.Limit{Rate: 10, PerKey: 1, KeyFunc: key})
	require.NoError(t, err)
	l := d.Step(0).Limit
	require.Equal(t, "pay.charge", l.Name, "a step's own limit by default")
	require.Equal(t, time.Second, l.Per)
	require.Equal(t, 100*time.Millisecond, l.Spacing())
	d, err = build(saga.ExternalStep, saga.Limit{})
	require.NoError(t, err)
	require.True(t, d.Step(0).Limit.IsZero(), "no limit")
}
