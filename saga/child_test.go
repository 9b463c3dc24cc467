package saga_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// childStep is a valid child step running child.
func childStep(name string, reaches saga.State, child *saga.Definition) saga.Step {
	return saga.Step{Name: name, Reaches: reaches, Kind: saga.ChildStep, Child: child}
}

// chain returns a definition whose children nest depth levels below it.
func chain(t *testing.T, prefix string, depth int) *saga.Definition {
	t.Helper()
	d := saga.MustNew(prefix+"0", step("a", "a"))
	for i := 1; i <= depth; i++ {
		d = saga.MustNew(fmt.Sprintf("%s%d", prefix, i), childStep("c", "c", d))
	}
	return d
}

// TestChildStepRules: a child step names its child and has no handlers
// of its own but its input's; a depth past ChildDepthMax, more child
// steps than ChildStepsMax and a cycle by name are refused with what to
// change, and nothing is built.
func TestChildStepRules(t *testing.T) {
	t.Parallel()
	fx := saga.MustNew("fx", step("convert", "converted"))
	for _, tc := range []struct {
		name  string
		def   func() (*saga.Definition, error)
		field string
		says  string
	}{
		{"no child", func() (*saga.Definition, error) {
			return saga.New("xfer", childStep("fx", "converted", nil))
		}, "steps[0].Child", "set Child"},
		{"child on another kind", func() (*saga.Definition, error) {
			s := step("fx", "converted")
			s.Child = fx
			return saga.New("xfer", s)
		}, "steps[0].Child", "only a saga.ChildStep runs a child"},
		{"own compensation", func() (*saga.Definition, error) {
			s := childStep("fx", "converted", fx)
			s.Compensate = noop
			return saga.New("xfer", s)
		}, "steps[0].Compensate", "its compensation is its child's"},
		{"verify", func() (*saga.Definition, error) {
			s := childStep("fx", "converted", fx)
			s.Verify = noop
			return saga.New("xfer", s)
		}, "steps[0].Verify", "remove Verify"},
		{"limit", func() (*saga.Definition, error) {
			s := childStep("fx", "converted", fx)
			s.Limit = saga.Limit{Concurrency: 1}
			return saga.New("xfer", s)
		}, "steps[0].Limit", "remove Limit"},
		{"cycle by name", func() (*saga.Definition, error) {
			return saga.New("fx", childStep("again", "again", fx))
		}, "steps[0].Child", "cycle"},
		{"cycle below", func() (*saga.Definition, error) {
			mid := saga.MustNew("mid", childStep("x", "x", saga.MustNew("top", step("a", "a"))))
			return saga.New("top", childStep("m", "m", mid))
		}, "steps[0].Child", "cycle"},
		{"too deep", func() (*saga.Definition, error) {
			return saga.New("deep", childStep("c", "c", chain(t, "deep", saga.ChildDepthMax)))
		}, "steps[0].Child", "ChildDepthMax"},
		{"too many", func() (*saga.Definition, error) {
			var steps []saga.Step
			for i := range saga.ChildStepsMax + 1 {
				steps = append(steps, childStep(fmt.Sprintf("c%d", i), saga.State(fmt.Sprintf("s%d", i)), fx))
			}
			return saga.New("wide", steps...)
		}, "Kind", "ChildStepsMax"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := tc.def()
			require.Nil(t, d)
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			var de *saga.DefinitionError
			require.ErrorAs(t, err, &de)
			require.Contains(t, de.Field, tc.field)
			require.Contains(t, err.Error(), tc.says)
		})
	}

	// At the bounds, it builds.
	_, err := saga.New("deepest", childStep("c", "c", chain(t, "deepest", saga.ChildDepthMax-1)))
	require.NoError(t, err)
	var steps []saga.Step
	for i := range saga.ChildStepsMax {
		steps = append(steps, childStep(fmt.Sprintf("c%d", i), saga.State(fmt.Sprintf("s%d", i)), fx))
	}
	wide, err := saga.New("widest", steps...)
	require.NoError(t, err)
	require.Equal(t, []*saga.Definition{fx}, wide.Children(), "each child once")
}

// TestChildStepDescribed: a child step describes its child by name and
// version, and a definition rebuilt from its description knows it (and
// still compensates the step), so a process without the code can run
// repairs on a parent.
func TestChildStepDescribed(t *testing.T) {
	t.Parallel()
	fx := saga.WithVersion(saga.MustNew("fx", step("convert", "converted")), 3)
	xfer := saga.MustNew("xfer", step("debit", "debited"), childStep("fx", "converted", fx))
	require.Equal(t, "child", xfer.Step(1).Kind.String())
	require.NotNil(t, xfer.Step(1).Compensate, "the compensation plan undoes a child step")
	require.Equal(t, saga.CallbackWaitDefault, xfer.Step(1).Wait)
	desc := xfer.Describe()
	require.Equal(t, "fx@3", desc.Steps[1].Child)
	back, err := saga.FromDescription(desc)
	require.NoError(t, err)
	name, version, ok := back.Child(1)
	require.True(t, ok)
	require.Equal(t, "fx", name)
	require.Equal(t, 3, version)
	require.NotNil(t, back.Step(1).Compensate)
	require.Equal(t, desc.Fingerprint(), back.Describe().Fingerprint())
	_, _, ok = back.Child(0)
	require.False(t, ok)

	key := saga.StepKey(uuid.MustParse("0190a1b2-0000-7000-8000-000000000001"), "fx", saga.PhaseForward)
	require.NoError(t, saga.CheckKey(saga.ChildKey(key)), "a child's key is a valid key")
	require.Equal(t, saga.ChildKey(key), saga.ChildKey(key))

	for _, bad := range []string{"fx", "fx@0", "fx@x", "@1", "fx@01"} {
		_, _, err := saga.ParseRef(bad)
		require.Error(t, err, bad)
	}
}
