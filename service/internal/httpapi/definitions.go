package httpapi

import (
	"net/http"
	"slices"
	"time"

	"github.com/idemsaga/idemsaga/saga"
)

// Definition is an entry of GET /v1/definitions: a saga definition as the
// deployment recorded it, at its newest version.
type Definition struct {
	Name string `json:"name"`
	// Version is the newest version recorded.
	Version int `json:"version"`
	// Steps are the steps of that version, in order.
	Steps []DefinitionStep `json:"steps"`
	// FinalState is the state of a completed saga of that version.
	FinalState saga.State `json:"final_state"`
	// States lists every state a saga of the definition can be in, at
	// any recorded version: init, the steps' states in order, then the
	// built-in ones.
	States []saga.State `json:"states"`
	// Paused says since when, by whom and why the definition is paused as
	// a whole (POST /v1/definitions/{definition}/pause); null while it
	// runs.
	Paused *DefinitionPause `json:"paused"`
}

// DefinitionPause is a definition's pause.
type DefinitionPause struct {
	Since  time.Time `json:"since"`
	By     string    `json:"by"`
	Reason string    `json:"reason"`
}

// DefinitionStep is one step of a Definition.
type DefinitionStep struct {
	Name    string     `json:"name"`
	Reaches saga.State `json:"reaches"`
	// Kind is database, external or callback.
	Kind string `json:"kind"`
	// Compensates says whether the step has a compensation.
	Compensates bool `json:"compensates"`
}

// Definitions is the body of GET /v1/definitions.
type Definitions struct {
	// Definitions are sorted by name.
	Definitions []Definition `json:"definitions"`
}

// builtinStates are the states every saga can reach besides its steps'.
var builtinStates = []saga.State{saga.StateCompensating, saga.StateCompensated, saga.StateFailed, saga.StateParked, saga.StateClosed}

// definitions handles GET /v1/definitions.
func (a *api) definitions(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := a.readContext(r)
	defer cancel()
	descs, err := a.cfg.Client.Definitions(ctx)
	if err != nil {
		a.internal(w, r, "list the definitions", "retry later", err)
		return
	}
	paused, err := a.cfg.Client.PausedDefinitions(ctx)
	if err != nil {
		a.internal(w, r, "list the paused definitions", "retry later", err)
		return
	}
	out := Definitions{Definitions: []Definition{}}
	// descs is ordered by name, then version: the last of a name is its
	// newest.
	for i, d := range descs {
		if i > 0 && descs[i-1].Name == d.Name {
			out.Definitions[len(out.Definitions)-1] = definitionOf(d, out.Definitions[len(out.Definitions)-1].States)
			continue
		}
		out.Definitions = append(out.Definitions, definitionOf(d, nil))
	}
	for i, d := range out.Definitions {
		for _, p := range paused {
			if p.Definition == d.Name {
				out.Definitions[i].Paused = &DefinitionPause{Since: p.Since.UTC(), By: p.By, Reason: p.Reason}
			}
		}
	}
	a.encode(w, r, http.StatusOK, out)
}

// definitionOf describes d, keeping the states of its older versions
// (older) after init and d's steps' own.
func definitionOf(d saga.Description, older []saga.State) Definition {
	def := Definition{Name: d.Name, Version: max(d.Version, 1), Steps: make([]DefinitionStep, 0, len(d.Steps)), States: []saga.State{saga.StateInit}}
	for _, st := range d.Steps {
		def.Steps = append(def.Steps, DefinitionStep{Name: st.Name, Reaches: st.Reaches, Kind: st.Kind, Compensates: st.Compensates})
		def.States = append(def.States, st.Reaches)
		def.FinalState = st.Reaches
	}
	for _, s := range older {
		if !slices.Contains(def.States, s) && !slices.Contains(builtinStates, s) {
			def.States = append(def.States, s)
		}
	}
	def.States = append(def.States, builtinStates...)
	return def
}
