// Package planview lays out a saga's plan for reading: its forward steps
// in order, the branches of a parallel group side by side in one stage,
// each with the status its saga recorded. show and the API's saga body
// (which the console draws) read it.
package planview

import "github.com/idemsaga/idemsaga/saga"

// Pending is the status of a step the saga has not reached.
const Pending saga.StepStatus = "pending"

// Step is one step of a stage.
type Step struct {
	Name string `json:"name"`
	Kind string `json:"kind"`
	// Conditional says the step runs only when its condition holds.
	Conditional bool `json:"conditional"`
	// Child is a child step's child definition, "name@version"; empty
	// for other steps.
	Child string `json:"child,omitempty"`
	// Status is the forward step's (Pending before it is reached,
	// skipped when its condition skipped it), and Compensation its
	// compensation's, empty when none ran.
	Status       saga.StepStatus `json:"status"`
	Compensation saga.StepStatus `json:"compensation,omitempty"`
}

// Stage is a step of the line, or a parallel group whose branches run
// side by side.
type Stage struct {
	// Group names the parallel group; empty for a step of the line.
	Group string `json:"group,omitempty"`
	Steps []Step `json:"steps"`
}

// Of lays out the plan of d for the saga whose step executions are
// steps and skipped steps skipped.
func Of(d saga.Description, steps []saga.StepExecution, skipped []string) []Stage {
	status := map[string]saga.StepStatus{}
	undo := map[string]saga.StepStatus{}
	for _, st := range steps {
		if st.Phase == saga.PhaseCompensate {
			undo[st.Step] = st.Status
		} else {
			status[st.Step] = st.Status
		}
	}
	for _, name := range skipped {
		status[name] = saga.StepSkipped
	}
	var out []Stage
	for _, st := range d.Steps {
		s := Step{Name: st.Name, Kind: st.Kind, Conditional: st.Conditional, Child: st.Child, Status: Pending, Compensation: undo[st.Name]}
		if have, ok := status[st.Name]; ok {
			s.Status = have
		}
		if st.Group != "" && len(out) > 0 && out[len(out)-1].Group == st.Group {
			out[len(out)-1].Steps = append(out[len(out)-1].Steps, s)
			continue
		}
		out = append(out, Stage{Group: st.Group, Steps: []Step{s}})
	}
	return out
}
