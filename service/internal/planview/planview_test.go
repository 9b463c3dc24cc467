package planview_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/planview"
)

// TestOf: a group's branches share one stage, side by side; each step
// carries the status its saga recorded, pending before it is reached,
// skipped when its condition skipped it, and its compensation's.
func TestOf(t *testing.T) {
	ok := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	child := saga.MustNew("fx", saga.Step{Name: "quote", Reaches: "quoted", Kind: saga.DatabaseStep, Forward: ok})
	d := saga.MustNew("order",
		saga.Step{Name: "reserve", Group: "hold", Reaches: "held", Kind: saga.DatabaseStep, Forward: ok, Compensate: ok},
		saga.Step{Name: "authorize", Group: "hold", Reaches: "held", Kind: saga.DatabaseStep, Forward: ok, Compensate: ok},
		saga.Step{Name: "fx", Reaches: "converted", Kind: saga.ChildStep, Child: child},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Forward: ok,
			When: saga.Condition{Func: func(*saga.StepContext) bool { return false }}},
	)
	plan := planview.Of(d.Describe(), []saga.StepExecution{
		{Step: "reserve", Phase: saga.PhaseForward, Status: saga.StepSucceeded},
		{Step: "reserve", Phase: saga.PhaseCompensate, Status: saga.StepDispatched},
		{Step: "authorize", Phase: saga.PhaseForward, Status: saga.StepFailed},
	}, []string{"ship"})
	require.Equal(t, []planview.Stage{
		{Group: "hold", Steps: []planview.Step{
			{Name: "reserve", Kind: "database", Status: saga.StepSucceeded, Compensation: saga.StepDispatched},
			{Name: "authorize", Kind: "database", Status: saga.StepFailed},
		}},
		{Steps: []planview.Step{{Name: "fx", Kind: "child", Child: "fx@1", Status: planview.Pending}}},
		{Steps: []planview.Step{{Name: "ship", Kind: "database", Conditional: true, Status: saga.StepSkipped}}},
	}, plan)
}
