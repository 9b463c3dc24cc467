package service

import (
	"bytes"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/planview"
)

// TestShowPrintsParentAndChildren: show names a child saga's parent and
// the step that started it, a parent's children, and which child a
// waiting child step waits for.
func TestShowPrintsParentAndChildren(t *testing.T) {
	parent, child := uuid.New(), uuid.New()
	until := time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)
	var out bytes.Buffer
	plan := []planview.Stage{
		{Steps: []planview.Step{{Name: "debit", Status: saga.StepSucceeded}}},
		{Steps: []planview.Step{{Name: "fx", Child: "fx@1", Status: saga.StepWaiting}}},
		{Group: "pay", Steps: []planview.Step{{Name: "credit", Status: planview.Pending}, {Name: "notify", Status: planview.Pending}}},
	}
	printSaga(&out, &saga.Instance{ID: parent, Definition: "xfer", State: "debited",
		Steps: []saga.StepExecution{
			{Step: "debit", Phase: saga.PhaseForward, Kind: "external", Status: saga.StepSucceeded, Attempt: 1},
			{Step: "fx", Phase: saga.PhaseForward, Kind: "child", Status: saga.StepWaiting, Attempt: 1, LeaseUntil: &until},
		},
		Children: []saga.ChildRecord{{Step: "fx", ID: child, Definition: "fx", State: "quoted"}},
	}, plan)
	require.Contains(t, out.String(), "debit succeeded → fx (child fx@1) waiting → pay [credit pending | notify pending]")
	require.Regexp(t, `fx\s+child\s+forward\s+waiting\s+1\s+\S+\s+waits for its child saga until 2026-12-03T07:00:00Z: `+child.String()+` \(quoted\)`, out.String())
	require.Contains(t, out.String(), "child sagas")
	require.Regexp(t, `fx\s+`+child.String()+`\s+fx\s+quoted`, out.String())

	out.Reset()
	printSaga(&out, &saga.Instance{ID: child, Definition: "fx", State: "quoted", Parent: &parent, ParentStep: "fx"}, nil)
	require.Regexp(t, `parent\s+`+parent.String()+` \(its step fx started this saga\)`, out.String())
	require.NotContains(t, out.String(), "child sagas")
	require.NotContains(t, out.String(), "plan", "no plan without the definition")
}
