package saga_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// TestDeadlineTravelsInTheDescription: a process without the code knows
// the deadline, and a definition without one keeps its fingerprint.
func TestDeadlineTravelsInTheDescription(t *testing.T) {
	base := saga.MustNew("d", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	require.Zero(t, base.Deadline())
	require.NotContains(t, base.Describe().Fingerprint(), "deadline")

	def := saga.WithDeadline(base, 90*time.Second)
	require.Equal(t, 90*time.Second, def.Deadline())
	require.Zero(t, base.Deadline(), "WithDeadline returns a copy")
	back, err := saga.FromDescription(def.Describe())
	require.NoError(t, err)
	require.Equal(t, 90*time.Second, back.Deadline())
	require.Equal(t, def.Describe().Fingerprint(), back.Describe().Fingerprint())

	desc := def.Describe()
	desc.Deadline = "-1s"
	_, err = saga.FromDescription(desc)
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.Panics(t, func() { saga.WithDeadline(base, 0) })
}
