package compensation_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/saga"
)

func noop(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }

// definition builds a saga whose step i has a compensation when
// compensable[i] is true.
func definition(t *testing.T, compensable ...bool) *saga.Definition {
	t.Helper()
	steps := make([]saga.Step, len(compensable))
	for i, c := range compensable {
		steps[i] = saga.Step{Name: fmt.Sprintf("s%d", i), Reaches: saga.State(fmt.Sprintf("r%d", i)), Kind: saga.ExternalStep, Forward: noop}
		if c {
			steps[i].Compensate = noop
		}
	}
	def, err := saga.New("d", steps...)
	require.NoError(t, err)
	return def
}

func TestPlan(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		compensable []bool
		failed      int
		want        []int
	}{
		{"first step fails", []bool{true, true, true}, 0, nil},
		{"first step without compensation fails", []bool{false, true}, 0, nil},
		{"only step fails", []bool{false}, 0, nil},
		{"step 2 of 3 fails, step 1 not compensable", []bool{true, false, true}, 2, []int{0}},
		{"last step fails, all compensable", []bool{true, true, true, true}, 3, []int{2, 1, 0}},
		{"last step fails, none compensable", []bool{false, false, false}, 2, nil},
		{"middle step fails", []bool{true, true, false, true, true}, 3, []int{1, 0}},
		{"failing step is never in the plan", []bool{true, true}, 1, []int{0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			def := definition(t, tt.compensable...)
			plan, park := compensation.Plan(def, tt.failed, compensation.NotDone, nil)
			require.False(t, park)
			require.Equal(t, tt.want, plan)
			for i := 0; i+1 < len(plan); i++ {
				require.Equal(t, plan[i+1], compensation.Next(def, plan[i], nil))
			}
			if len(plan) > 0 {
				require.Equal(t, -1, compensation.Next(def, plan[len(plan)-1], nil))
			}
		})
	}
}

func TestNext(t *testing.T) {
	t.Parallel()
	def := definition(t, true, false, true, false)
	require.Equal(t, 2, compensation.Next(def, 3, nil))
	require.Equal(t, 0, compensation.Next(def, 2, nil))
	require.Equal(t, 0, compensation.Next(def, 1, nil))
	require.Equal(t, -1, compensation.Next(def, 0, nil))
	require.Panics(t, func() { compensation.Next(def, -1, nil) })
	require.Panics(t, func() { compensation.Next(def, 4, nil) })
}

func TestPlanPanicsOutOfRange(t *testing.T) {
	t.Parallel()
	def := definition(t, true, true)
	require.Panics(t, func() { compensation.Plan(def, -1, compensation.NotDone, nil) })
	require.Panics(t, func() { compensation.Plan(def, 2, compensation.PossiblyDone, nil) })
}

func TestPlanProperties(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(7, 11))
	for range 2000 {
		n := 1 + r.IntN(8)
		compensable := make([]bool, n)
		for i := range compensable {
			compensable[i] = r.IntN(2) == 0
		}
		def := definition(t, compensable...)
		failed := r.IntN(n)
		effect := compensation.Effect(r.IntN(3))
		plan, park := compensation.Plan(def, failed, effect, nil)
		desc := fmt.Sprintf("compensable %v failed %d effect %d plan %v park %v", compensable, failed, effect, plan, park)

		// A possibly-done step without a compensation parks, and nothing
		// is compensated.
		if effect == compensation.PossiblyDone && !compensable[failed] {
			require.True(t, park, desc)
			require.Empty(t, plan, desc)
			continue
		}
		require.False(t, park, desc)

		// A step whose Verify said "not done" never parks, and is
		// compensated first when it can be (its undo voids the key).
		// Strictly decreasing, from the failed step when it may have
		// taken effect, below it otherwise: the reverse of the order in
		// which steps started.
		top := failed
		own := effect == compensation.PossiblyDone || effect == compensation.VerifiedNotDone && compensable[failed]
		if own {
			top = failed + 1
			require.Equal(t, failed, plan[0], desc)
		}
		for i := range plan {
			require.Less(t, plan[i], top, desc)
		}
		for i := 1; i < len(plan); i++ {
			require.Less(t, plan[i], plan[i-1], desc)
		}

		// Exactly every compensable step that started and may have
		// taken effect.
		want := map[int]bool{}
		for i := range top {
			if compensable[i] {
				want[i] = true
			}
		}
		got := map[int]bool{}
		for _, i := range plan {
			got[i] = true
		}
		require.Equal(t, want, got, desc)
		require.Len(t, plan, len(want), desc)

		// Next walks the same plan and ends with -1.
		for i := 0; i+1 < len(plan); i++ {
			require.Equal(t, plan[i+1], compensation.Next(def, plan[i], nil), desc)
		}
		if len(plan) > 0 {
			require.Equal(t, -1, compensation.Next(def, plan[len(plan)-1], nil), desc)
		}

		// Walking with Next alone from the failed step visits the rest
		// of the plan.
		var walk []int
		if own {
			walk = append(walk, failed)
		}
		for next := compensation.Next(def, failed, nil); next >= 0; next = compensation.Next(def, next, nil) {
			walk = append(walk, next)
		}
		require.Equal(t, plan, walk, desc)
	}
}

func ExamplePlan() {
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def := saga.MustNew("transfer",
		saga.Step{Name: "debit", Reaches: "debited", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "audit", Reaches: "audited", Kind: saga.DatabaseStep, Forward: noop},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: noop},
	)
	// charge was refused (it took no effect), audit has nothing to undo,
	// so only debit is compensated.
	fmt.Println(compensation.Plan(def, 2, compensation.NotDone, nil))
	// charge timed out: it may have charged, so its refund comes first.
	fmt.Println(compensation.Plan(def, 2, compensation.PossiblyDone, nil))
	// notify timed out and cannot be undone: the saga parks.
	fmt.Println(compensation.Plan(def, 3, compensation.PossiblyDone, nil))
	// notify timed out, and its Verify found it not done: no park; the
	// steps before it are compensated.
	fmt.Println(compensation.Plan(def, 3, compensation.VerifiedNotDone, nil))
	// charge timed out, its Verify found it not done: its refund still
	// comes first, to void the key against a late charge.
	fmt.Println(compensation.Plan(def, 2, compensation.VerifiedNotDone, nil))
	fmt.Println(compensation.Next(def, 2, nil), compensation.Next(def, 0, nil))

	// Output:
	// [0] false
	// [2 0] false
	// [] true
	// [2 0] false
	// [2 0] false
	// 0 -1
}

func TestSkippedStepsAreNeverCompensated(t *testing.T) {
	t.Parallel()
	def := definition(t, true, true, true, true)
	skipped := []string{"s1", "s2"}
	plan, park := compensation.Plan(def, 3, compensation.PossiblyDone, skipped)
	require.False(t, park)
	require.Equal(t, []int{3, 0}, plan)
	require.Equal(t, 0, compensation.Next(def, 3, skipped))
	require.Equal(t, -1, compensation.Next(def, 0, skipped))
	plan, _ = compensation.Plan(def, 3, compensation.NotDone, []string{"s0"})
	require.Equal(t, []int{2, 1}, plan)
}

// TestWalkCompensatesGroupsConcurrentlyInReverse checks the walk over a
// saga with a parallel group: a, then group {b, c, d}, then e.
func TestWalkCompensatesGroupsConcurrentlyInReverse(t *testing.T) {
	t.Parallel()
	step := func(name string, undo bool) saga.Step {
		s := saga.Step{Name: name, Reaches: saga.State(name + "_done"), Kind: saga.ExternalStep, Forward: noop}
		if undo {
			s.Compensate = noop
		}
		return s
	}
	branch := func(name string, undo bool) saga.Step {
		s := step(name, undo)
		s.Group, s.Reaches = "g", "grouped"
		return s
	}
	def, err := saga.New("w", step("a", true), branch("b", true), branch("c", true), branch("d", false), step("e", true))
	require.NoError(t, err)
	ok, failed := saga.StepSucceeded, saga.StepFailed
	ex := map[string]compensation.Execution{
		"a": {Forward: ok}, "b": {Forward: ok}, "c": {Forward: failed, PossiblyDone: true}, "d": {Forward: ok},
	}
	// c failed possibly done, b succeeded: both at once; d has nothing
	// to undo.
	f := compensation.Walk(def, nil, ex)
	require.Equal(t, []int{1, 2}, f.Dispatch)
	require.False(t, f.Done)

	ex["b"] = compensation.Execution{Forward: ok, Compensate: saga.StepDispatched}
	ex["c"] = compensation.Execution{Forward: failed, PossiblyDone: true, Compensate: ok}
	f = compensation.Walk(def, nil, ex)
	require.Empty(t, f.Dispatch, "b's compensation still runs: a waits")
	require.False(t, f.Done)

	ex["b"] = compensation.Execution{Forward: ok, Compensate: ok}
	f = compensation.Walk(def, nil, ex)
	require.Equal(t, []int{0}, f.Dispatch, "the group is undone: the step before it")

	ex["a"] = compensation.Execution{Forward: ok, Compensate: ok}
	f = compensation.Walk(def, nil, ex)
	require.True(t, f.Done)

	// A branch still running forward holds the group.
	f = compensation.Walk(def, nil, map[string]compensation.Execution{"a": {Forward: ok}, "b": {Forward: saga.StepDispatched}, "c": {Forward: failed}})
	require.Empty(t, f.Dispatch)
	require.False(t, f.Done)

	// A failed compensation fails the saga once none runs beside it.
	ex = map[string]compensation.Execution{"a": {Forward: ok}, "b": {Forward: ok, Compensate: failed}, "c": {Forward: ok, Compensate: saga.StepRetrying}, "d": {Forward: failed}}
	f = compensation.Walk(def, nil, ex)
	require.Equal(t, -1, f.Failed)
	require.Empty(t, f.Dispatch)
	ex["c"] = compensation.Execution{Forward: ok, Compensate: ok}
	f = compensation.Walk(def, nil, ex)
	require.Equal(t, 1, f.Failed)

	// A skipped branch took no effect; a failed one not possibly done
	// neither.
	f = compensation.Walk(def, []string{"b"}, map[string]compensation.Execution{"a": {Forward: ok}, "b": {Forward: ok}, "c": {Forward: failed}})
	require.Equal(t, []int{0}, f.Dispatch)
}

// TestWalkAgreesWithPlanOnALine checks Walk against Plan and Next on
// random lines: it dispatches the plan's entries one at a time, in order.
func TestWalkAgreesWithPlanOnALine(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(7, 11))
	for range 500 {
		n := 1 + r.IntN(7)
		compensable := make([]bool, n)
		for i := range compensable {
			compensable[i] = r.IntN(2) == 0
		}
		def := definition(t, compensable...)
		failed := r.IntN(n)
		possibly := r.IntN(2) == 0
		effect := compensation.NotDone
		if possibly {
			effect = compensation.PossiblyDone
		}
		plan, park := compensation.Plan(def, failed, effect, nil)
		if park {
			continue
		}
		ex := map[string]compensation.Execution{}
		for i := range failed {
			ex[fmt.Sprintf("s%d", i)] = compensation.Execution{Forward: saga.StepSucceeded}
		}
		ex[fmt.Sprintf("s%d", failed)] = compensation.Execution{Forward: saga.StepFailed, PossiblyDone: possibly}
		var walked []int
		for {
			f := compensation.Walk(def, nil, ex)
			if f.Done {
				break
			}
			require.Len(t, f.Dispatch, 1)
			walked = append(walked, f.Dispatch[0])
			e := ex[fmt.Sprintf("s%d", f.Dispatch[0])]
			e.Compensate = saga.StepSucceeded
			ex[fmt.Sprintf("s%d", f.Dispatch[0])] = e
		}
		require.Equal(t, plan, walked, "compensable %v failed %d possibly %v", compensable, failed, possibly)
	}
}
