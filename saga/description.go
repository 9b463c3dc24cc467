package saga

import (
	"context"
	"encoding/json"
	"fmt"
	"time"
)

// Description is a definition without its code: its name, its input
// type's name and its steps with their kinds and policies. The engine
// records each definition's description in the database, so that every
// process of a deployment can check it runs the same definition, and so
// that a process without the handlers (an admin CLI, an API gateway) can
// start, show and repair sagas of it.
type Description struct {
	Name  string `json:"name"`
	Input string `json:"input,omitempty"`
	// InputFields are the JSON members of a struct input type: a
	// definition rebuilt from the description refuses any other.
	InputFields []string          `json:"input_fields,omitempty"`
	Steps       []StepDescription `json:"steps"`
	// Deadline is the definition's saga deadline (WithDeadline), empty
	// for none.
	Deadline string `json:"deadline,omitempty"`
	// SignedCallbacks says its callbacks must be signed
	// (WithCallbackSecrets); the secrets are never described.
	SignedCallbacks bool `json:"signed_callbacks,omitempty"`

	// Version is the definition's version (Definition.Version); a
	// description without one is of version 1.
	Version int `json:"version,omitempty"`
	// Schedule is the definition's schedule (WithSchedule), Events what
	// starts its sagas from messages (WithEvents); nil for none.
	Schedule *ScheduleDescription `json:"schedule,omitempty"`
	Events   *EventsDescription   `json:"events,omitempty"`
}

// StepDescription describes one step of a Description.
type StepDescription struct {
	Name            string            `json:"name"`
	Reaches         State             `json:"reaches"`
	Kind            string            `json:"kind"`
	Compensates     bool              `json:"compensates"`
	Retry           PolicyDescription `json:"retry"`
	CompensateRetry PolicyDescription `json:"compensate_retry"`
	// Wait is a callback step's Step.Wait.
	Wait string `json:"wait,omitempty"`
	// ChecksCallbacks says the step has a CheckCallback, which lives in
	// the definition's code.
	ChecksCallbacks bool `json:"checks_callbacks,omitempty"`
	// Verifies says the step has a Verify.
	Verifies bool `json:"verifies,omitempty"`
	// Conditional says the step has a condition (Step.When), which lives
	// in the definition's code; Reads are the steps it reads.
	Conditional bool     `json:"conditional,omitempty"`
	Reads       []string `json:"reads,omitempty"`
	// Group is the step's parallel group (Step.Group), empty for none.
	Group string `json:"group,omitempty"`
	// Child is a child step's child definition, as "name@version".
	Child string `json:"child,omitempty"`
}

// PolicyDescription is a RetryPolicy with readable durations.
type PolicyDescription struct {
	MaxAttempts    int     `json:"max_attempts"`
	InitialBackoff string  `json:"initial_backoff"`
	MaxBackoff     string  `json:"max_backoff"`
	Multiplier     float64 `json:"multiplier"`
	Jitter         float64 `json:"jitter"`
	Timeout        string  `json:"timeout"`
}

func describePolicy(p RetryPolicy) PolicyDescription {
	return PolicyDescription{MaxAttempts: p.MaxAttempts, InitialBackoff: p.InitialBackoff.String(), MaxBackoff: p.MaxBackoff.String(),
		Multiplier: p.Multiplier, Jitter: p.Jitter, Timeout: p.Timeout.String()}
}

func (p PolicyDescription) policy() (RetryPolicy, error) {
	var out RetryPolicy
	var err error
	out.MaxAttempts, out.Multiplier, out.Jitter = p.MaxAttempts, p.Multiplier, p.Jitter
	for _, f := range []struct {
		text string
		to   *time.Duration
	}{{p.InitialBackoff, &out.InitialBackoff}, {p.MaxBackoff, &out.MaxBackoff}, {p.Timeout, &out.Timeout}} {
		if *f.to, err = time.ParseDuration(f.text); err != nil {
			return out, err
		}
	}
	return out, nil
}

// Describe returns the definition's description.
func (d *Definition) Describe() Description {
	desc := Description{Name: d.name, Version: d.version, Input: d.InputType(), InputFields: d.inputFields, Steps: make([]StepDescription, len(d.steps))}
	if d.input != nil {
		desc.InputFields = d.input.fields
	}
	if d.deadline > 0 {
		desc.Deadline = d.deadline.String()
	}
	desc.SignedCallbacks = d.signed
	desc.Schedule, desc.Events = d.describeSchedule(), d.describeEvents()
	for i, s := range d.steps {
		desc.Steps[i] = StepDescription{Name: s.Name, Reaches: s.Reaches, Kind: s.Kind.String(), Compensates: s.Compensate != nil,
			Retry: describePolicy(s.Retry), CompensateRetry: describePolicy(s.CompensateRetry)}
		desc.Steps[i].Verifies = s.Verify != nil
		if !s.When.IsZero() {
			desc.Steps[i].Conditional, desc.Steps[i].Reads = true, s.When.Reads
		}
		desc.Steps[i].Group = s.Group
		if s.Kind == CallbackStep || s.Kind == ChildStep {
			desc.Steps[i].Wait = s.Wait.String()
			desc.Steps[i].ChecksCallbacks = s.CheckCallback != nil
		}
		if name, version, ok := d.Child(i); ok {
			desc.Steps[i].Child = Ref(name, version)
		}
	}
	return desc
}

// Fingerprint returns the description as canonical JSON: two processes
// run the same definition when their fingerprints are equal.
func (desc Description) Fingerprint() string {
	b, _ := json.Marshal(desc)
	return string(b)
}

// FromDescription rebuilds a definition from its description. It has no
// handlers: an engine client can start, read and repair sagas with it,
// and the steps run in a process that has the definition's code. Its
// input is checked as JSON (no duplicate or case-twin members) and, for
// a struct input type, against the type's member names; the validator,
// which lives in that code, does not run.
func FromDescription(desc Description) (*Definition, error) {
	steps := make([]Step, len(desc.Steps))
	childRefs := map[int]string{}
	for i, s := range desc.Steps {
		st := Step{Name: s.Name, Reaches: s.Reaches, Forward: describedHandler, Group: s.Group}
		switch s.Kind {
		case DatabaseStep.String():
			st.Kind = DatabaseStep
		case ExternalStep.String():
			st.Kind = ExternalStep
		case CallbackStep.String(), ChildStep.String():
			st.Kind = CallbackStep
			if s.Kind == ChildStep.String() {
				st.Kind, st.Forward, childRefs[i] = ChildStep, nil, s.Child
			}
			w, err := time.ParseDuration(s.Wait)
			if err != nil {
				return nil, fmt.Errorf("%w: description of %q: step %q: wait %q: %v", ErrInvalidDefinition, desc.Name, s.Name, s.Wait, err)
			}
			st.Wait = w
			if s.ChecksCallbacks {
				st.CheckCallback = describedCheck
			}
		default:
			return nil, fmt.Errorf("%w: description of %q: step %q has kind %q", ErrInvalidDefinition, desc.Name, s.Name, s.Kind)
		}
		var err error
		if st.Retry, err = s.Retry.policy(); err != nil {
			return nil, fmt.Errorf("%w: description of %q: step %q: retry: %v", ErrInvalidDefinition, desc.Name, s.Name, err)
		}
		if st.CompensateRetry, err = s.CompensateRetry.policy(); err != nil {
			return nil, fmt.Errorf("%w: description of %q: step %q: compensate retry: %v", ErrInvalidDefinition, desc.Name, s.Name, err)
		}
		if s.Compensates {
			st.Compensate = describedHandler
		}
		if s.Verifies {
			st.Verify = describedHandler
		}
		if s.Conditional {
			st.When = Condition{Reads: s.Reads, elsewhere: true}
		}
		steps[i] = st
	}
	d, err := buildWith(desc.Name, steps, true, childRefs)
	if err != nil {
		return nil, err
	}
	if desc.Version < 0 {
		return nil, fmt.Errorf("%w: description of %q: version %d; versions start at 1", ErrInvalidDefinition, desc.Name, desc.Version)
	}
	d.inputName, d.inputFields, d.version, d.signed = desc.Input, desc.InputFields, max(desc.Version, 1), desc.SignedCallbacks
	if d.schedule, err = desc.Schedule.schedule(desc.Name); err != nil {
		return nil, err
	}
	if d.events, err = desc.Events.events(desc.Name); err != nil {
		return nil, err
	}
	if desc.Deadline != "" {
		if d.deadline, err = time.ParseDuration(desc.Deadline); err != nil || d.deadline <= 0 {
			return nil, fmt.Errorf("%w: description of %q: deadline %q is not a positive duration", ErrInvalidDefinition, desc.Name, desc.Deadline)
		}
	}
	return d, nil
}

// describedHandler stands for a compensation that lives in another
// process: it tells the compensation exists, and refuses to run.
func describedHandler(_ context.Context, sc *StepContext) (json.RawMessage, error) {
	return nil, fmt.Errorf("idemsaga: the handlers of saga %q are not in this process; run its steps in a worker built with its code", sc.Definition)
}

// describedCheck stands for a callback check that lives in another
// process: a callback it cannot check is refused.
func describedCheck(_ context.Context, sc *StepContext, _ json.RawMessage) error {
	return fmt.Errorf("step %q of saga %q checks its callbacks in its code, which is not in this process; deliver the callback to a process built with it", sc.Step, sc.Definition)
}

// Runnable reports whether the definition has its handlers, so that an
// engine can run its steps. A definition from FromDescription has not.
func (d *Definition) Runnable() bool { return !d.described }
