package httpapi

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// TestDefinitionOfVersions: the newest version's steps and final state,
// and the states of older versions a saga may still be in.
func TestDefinitionOfVersions(t *testing.T) {
	t.Parallel()
	v1 := saga.Description{Name: "order", Steps: []saga.StepDescription{{Name: "charge", Reaches: "charged", Kind: "external"}, {Name: "ship", Reaches: "shipped", Kind: "database"}}}
	v2 := saga.Description{Name: "order", Version: 2, Steps: []saga.StepDescription{{Name: "charge", Reaches: "charged", Kind: "external", Compensates: true}, {Name: "pack", Reaches: "packed", Kind: "database"}}}
	d := definitionOf(v2, definitionOf(v1, nil).States)
	require.Equal(t, 2, d.Version)
	require.Equal(t, saga.State("packed"), d.FinalState)
	require.Equal(t, []DefinitionStep{{Name: "charge", Reaches: "charged", Kind: "external", Compensates: true}, {Name: "pack", Reaches: "packed", Kind: "database"}}, d.Steps)
	require.Equal(t, []saga.State{"init", "charged", "packed", "shipped", "compensating", "compensated", "failed", "parked", "closed"}, d.States)
	require.Equal(t, 1, definitionOf(v1, nil).Version, "a description without a version is version 1")
}
