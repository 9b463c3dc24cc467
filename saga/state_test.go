package saga_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func TestCanTransition(t *testing.T) {
	t.Parallel()
	def := saga.MustNew("order",
		step("reserve", "reserved"),
		step("charge", "charged"),
		step("ship", "shipped"),
	)

	const (
		initial      = saga.StateInit
		compensating = saga.StateCompensating
		compensated  = saga.StateCompensated
		failed       = saga.StateFailed
		parked       = saga.StateParked
		closed       = saga.StateClosed
	)
	tests := []struct {
		from, to saga.State
		want     bool
	}{
		// Forward, one step at a time.
		{initial, "reserved", true},
		{"reserved", "charged", true},
		{"charged", "shipped", true},
		// Skipping a step.
		{initial, "charged", false},
		{initial, "shipped", false},
		{"reserved", "shipped", false},
		// Backwards, and staying put.
		{"charged", "reserved", false},
		{"shipped", "charged", false},
		{"reserved", initial, false},
		{"charged", initial, false},
		{initial, initial, false},
		{"reserved", "reserved", false},
		// Any non-terminal state may start compensating.
		{initial, compensating, true},
		{"reserved", compensating, true},
		{"charged", compensating, true},
		{compensating, compensating, false},
		// Compensation ends compensated or failed, and only from compensating.
		{compensating, compensated, true},
		{compensating, failed, true},
		{initial, compensated, false},
		{initial, failed, false},
		{"reserved", compensated, false},
		{"charged", failed, false},
		// Compensating never goes back to a step state or init.
		{compensating, initial, false},
		{compensating, "reserved", false},
		{compensating, "charged", false},
		{compensating, "shipped", false},
		// Nothing leaves a terminal state.
		{"shipped", compensating, false},
		{"shipped", compensated, false},
		{"shipped", failed, false},
		{"shipped", initial, false},
		{compensated, compensating, false},
		{compensated, failed, false},
		{compensated, "reserved", false},
		{failed, compensating, false},
		{failed, compensated, false},
		{failed, initial, false},
		// A forward state may park; nothing else may, and parked is terminal.
		{initial, parked, true},
		{"reserved", parked, true},
		{"charged", parked, true},
		{compensating, parked, false},
		{"shipped", parked, false},
		{compensated, parked, false},
		{failed, parked, false},
		{parked, compensating, false},
		{parked, "shipped", false},
		{parked, failed, false},
		{parked, initial, false},
		// Closed is reached by an operator's close only, and is terminal.
		{failed, closed, false},
		{parked, closed, false},
		{initial, closed, false},
		{compensating, closed, false},
		{closed, compensating, false},
		{closed, "reserved", false},
		{closed, initial, false},
		// Unknown states.
		{"unknown", "reserved", false},
		{"unknown", compensating, false},
		{initial, "unknown", false},
		{"reserved", "unknown", false},
		{"", "reserved", false},
		{initial, "", false},
		{"Reserved", "charged", false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s->%s", tt.from, tt.to), func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tt.want, def.CanTransition(tt.from, tt.to))
		})
	}
}

func TestCanTransitionSingleStep(t *testing.T) {
	t.Parallel()
	// The only step state is also the final, terminal one.
	def := saga.MustNew("one", step("only", "done"))
	require.True(t, def.CanTransition(saga.StateInit, "done"))
	require.True(t, def.CanTransition(saga.StateInit, saga.StateCompensating))
	require.False(t, def.CanTransition("done", saga.StateCompensating))
	require.True(t, def.IsTerminal("done"))
}

// randomDefinition returns a definition of 1 to 8 steps; about half of them
// have a compensation.
func randomDefinition(t *testing.T, r *rand.Rand) *saga.Definition {
	t.Helper()
	n := 1 + r.IntN(8)
	steps := make([]saga.Step, n)
	for i := range steps {
		steps[i] = step(fmt.Sprintf("step%d", i), saga.State(fmt.Sprintf("state%d", i)))
		if r.IntN(2) == 0 {
			steps[i].Compensate = noop
		}
	}
	// Shuffle the state names so that state order does not follow name order.
	r.Shuffle(n, func(i, j int) { steps[i].Reaches, steps[j].Reaches = steps[j].Reaches, steps[i].Reaches })
	def, err := saga.New(fmt.Sprintf("random%d", n), steps...)
	require.NoError(t, err)
	return def
}

// statesOf returns every state of def, plus one it does not know.
func statesOf(def *saga.Definition) []saga.State {
	states := []saga.State{saga.StateInit, saga.StateCompensating, saga.StateCompensated, saga.StateFailed, saga.StateParked, "no_such_state"}
	for _, s := range def.Steps() {
		states = append(states, s.Reaches)
	}
	return states
}

// rank orders the states of def so that every allowed move increases it; it
// returns -1 for a state def does not know.
func rank(def *saga.Definition, s saga.State) int {
	switch s {
	case saga.StateInit:
		return 0
	case saga.StateCompensating:
		return def.Len() + 1
	case saga.StateCompensated, saga.StateFailed, saga.StateParked:
		return def.Len() + 2
	}
	for i, st := range def.Steps() {
		if st.Reaches == s {
			return i + 1
		}
	}
	return -1
}

func TestCanTransitionIsOneWayDAG(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))

	for range 500 {
		def := randomDefinition(t, r)
		states := statesOf(def)

		// Every allowed move strictly increases the rank, so the graph has
		// no cycle; and the moves allowed are exactly the documented ones.
		for _, from := range states {
			for _, to := range states {
				ok := def.CanTransition(from, to)
				if ok {
					require.Greater(t, rank(def, to), rank(def, from), "%s -> %s", from, to)
				}
				require.Equal(t, modelCanTransition(def, from, to), ok, "%s -> %s in %d steps", from, to, def.Len())
			}
		}

		// A random walk from init never revisits a state and ends in a
		// terminal state, with no way out.
		cur := saga.StateInit
		visited := map[saga.State]bool{cur: true}
		for {
			var next []saga.State
			for _, s := range states {
				if def.CanTransition(cur, s) {
					next = append(next, s)
				}
			}
			if len(next) == 0 {
				break
			}
			require.False(t, def.IsTerminal(cur), "terminal state %s has moves %v", cur, next)
			cur = next[r.IntN(len(next))]
			require.False(t, visited[cur], "state %s visited twice", cur)
			visited[cur] = true
			require.LessOrEqual(t, len(visited), def.Len()+3)
		}
		require.True(t, def.IsTerminal(cur), "walk stuck in non-terminal state %s", cur)
	}
}

// modelCanTransition restates the transition rules independently of the
// implementation.
func modelCanTransition(def *saga.Definition, from, to saga.State) bool {
	rf, rt := rank(def, from), rank(def, to)
	if rf < 0 || rt < 0 || def.IsTerminal(from) {
		return false
	}
	switch {
	case from == saga.StateCompensating:
		return to == saga.StateCompensated || to == saga.StateFailed
	case to == saga.StateCompensating, to == saga.StateParked:
		return true
	case rt >= 1 && rt <= def.Len():
		return rt == rf+1
	}
	return false
}

func TestPhaseValid(t *testing.T) {
	t.Parallel()
	require.True(t, saga.PhaseForward.Valid())
	require.True(t, saga.PhaseCompensate.Valid())
	for _, p := range []saga.Phase{"", "Forward", "backward", "forward "} {
		require.False(t, p.Valid(), p)
	}
}
