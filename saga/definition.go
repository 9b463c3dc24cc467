package saga

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"time"
)

// HandlerFunc runs one attempt of one phase of a step. It receives the
// step's context, which carries the step key, the attempt number, the saga
// input and, in a DatabaseStep, the transaction the engine records the
// step's outcome in. It returns the step's result as JSON (nil for none).
//
// A handler runs once per attempt, and its error decides: nil is a
// success; an error marked with Permanent fails the step for good (the
// saga compensates); any other error is retried under the step's policy.
// The step's Kind says what an error means for the step's effect.
type HandlerFunc func(ctx context.Context, sc *StepContext) (json.RawMessage, error)

// StepKind says how a step takes effect, and so what the engine can know
// of an attempt that did not succeed. Every step must name its kind.
type StepKind int

const (
	// DatabaseStep: every effect of the step is a write through
	// StepContext.Tx, the transaction that also records the step key in
	// the inbox and commits the step's outcome. An attempt's effect
	// commits with its success or not at all, so a failed attempt took no
	// effect, and a crash or a lost answer is settled by the inbox.
	DatabaseStep StepKind = iota + 1
	// ExternalStep: the step calls another system, passing StepContext.Key
	// as that system's idempotency key. The engine holds no database
	// transaction or connection during the call. An attempt that ends in a
	// timeout, a transport error, a crash, a lease expiry or any error not
	// marked with Permanent or NotApplied has an unknown outcome: it may
	// have taken effect. A step with such an attempt is possibly done, and
	// when it is given up its own compensation runs first (see Step).
	ExternalStep
	// CallbackStep: the step's forward handler sends a request to another
	// system, as an ExternalStep does (passing StepContext.Key as its
	// idempotency key and StepContext.CallbackToken() as where to answer),
	// and the step then waits until that system calls back
	// (engine.Client.Complete, or POST /v1/callbacks/{token}). The
	// callback's result is the step's result; the handler's own result
	// only says the request was accepted. A callback delivered again, by
	// the other system's retries or a person's replay, is absorbed under
	// its event id. A step that heard nothing within Step.Wait of its
	// request is possibly done and given up. Its compensation is an
	// external call.
	CallbackStep
	// ChildStep: the step runs another definition, Step.Child, as a saga
	// of its own (its child), started under a key derived from the
	// step's key (ChildKey), so a redelivered or retried attempt finds the
	// same child. Its Forward, if set, returns the child's input (without
	// one, the child takes the parent's input). The step waits for the
	// child's end, as a CallbackStep waits for its callback, and up to
	// Step.Wait: a child that completes gives the step its results (an
	// object of the child's step results by step name); a child that
	// compensated fails the step, without effect; a child that failed
	// or was closed fails it as possibly done. When the parent
	// compensates, the engine cancels a running child, or compensates a
	// completed one, and waits for it to be compensated. It has no
	// Compensate, Verify or Limit of its own.
	ChildStep
)

// String returns "database", "external", "callback" or "child".
func (k StepKind) String() string {
	switch k {
	case DatabaseStep:
		return "database"
	case ExternalStep:
		return "external"
	case CallbackStep:
		return "callback"
	case ChildStep:
		return "child"
	}
	return fmt.Sprintf("StepKind(%d)", int(k))
}

// Step is one step of a saga: a forward action, an optional compensation,
// and the state the saga reaches when the forward action is done.
//
// When a forward step fails for good (a permanent error, or its attempts
// exhausted), the steps before it are compensated in reverse order. If the
// failed step is possibly done (an ExternalStep any of whose attempts had
// an unknown outcome), its own compensation runs first, under its
// compensation key: undoing what never happened must be harmless to the
// other system. A possibly-done step without a compensation parks the
// saga in StateParked, for a person to check the other system.
type Step struct {
	// Name identifies the step within its definition. It goes into the step
	// key, so renaming a step of a running saga gives it new keys. Letters,
	// digits, '_' and '-' only.
	Name string
	// Reaches is the saga state once this step's forward action succeeded,
	// such as "deducted". Unique within the definition.
	Reaches State
	// Kind says how the step takes effect: DatabaseStep, ExternalStep,
	// CallbackStep or ChildStep. It applies to both phases. Required.
	Kind StepKind
	// Forward performs the step. Required, except in a ChildStep, where
	// it returns the child's input (see ChildStep).
	Forward HandlerFunc
	// Child, for a ChildStep only, is the definition the step runs as
	// its child. It is built before its parent, so children cannot form
	// a cycle; they nest at most ChildDepthMax deep, and a definition
	// has at most ChildStepsMax child steps.
	Child *Definition
	// Compensate undoes a completed Forward. Optional: a step without one
	// has nothing to undo.
	Compensate HandlerFunc
	// Retry governs Forward. Zero fields take the defaults.
	Retry RetryPolicy
	// CompensateRetry governs Compensate. Zero fields take the defaults.
	// When its attempts run out the saga ends in StateFailed.
	CompensateRetry RetryPolicy
	// Wait, for a CallbackStep or a ChildStep only, is how long the step
	// waits for its callback once its request was accepted (for its
	// child's end once the child started; for the child's compensation
	// once the parent ordered it), measured on the database's clock;
	// past it the step is given up as possibly done (a child's
	// compensation: as failed). Defaults to CallbackWaitDefault; at most
	// CallbackWaitMax.
	Wait time.Duration
	// Verify, for an ExternalStep or a CallbackStep, asks the other system
	// what the step's key did when an attempt's outcome is unknown (its
	// answer lost, a 500, a timeout), before the engine retries,
	// compensates or parks: it runs with the attempt's StepContext,
	// under the same key. It answers as a handler does, about the key:
	// nil with the step's result if the key took effect (for a callback
	// step: the request was accepted), saga.NotApplied if it did not (the
	// attempt is then not possibly done), any other error if it cannot
	// tell (the give-up rule as without Verify). Its answer is recorded
	// with the attempt and counted. Optional.
	Verify HandlerFunc
	// CheckCallback, for a CallbackStep only, checks a callback's result
	// against what the step asked for (the amount, the currency, the
	// order), with sc as the step's forward attempt sees it (the input,
	// the earlier results), before the callback is applied. An error
	// refuses the callback: nothing is written, and the other system is
	// told why (engine.ErrInvalidCallback). It must not call other
	// systems: it runs under the saga's lock. Optional.
	CheckCallback func(ctx context.Context, sc *StepContext, result json.RawMessage) error
	// Limit, for an ExternalStep or a CallbackStep, bounds its calls as
	// the other system does (at once, per period, per tenant), across
	// every worker: see Limit. Optional.
	Limit Limit
	// When, if set, decides once whether the step runs, from the input
	// and earlier results: a step it skips reaches its state at once and
	// is never compensated. See Condition. The first step has none.
	// Optional.
	When Condition
	// Group, if set, makes the step a branch of a parallel group:
	// consecutive steps with the same Group run at the same time, each
	// with its own kind, key, retries and compensation, and all name the
	// same Reaches, the state the saga reaches when every branch
	// succeeded. If a branch fails for good, the branches running finish
	// their attempt, and every branch that succeeded or may have taken
	// effect is compensated, concurrently, before the steps before the
	// group in reverse. Letters, digits, '_' and '-'. Optional.
	Group string
}

// CallbackWaitDefault is how long a CallbackStep waits for its callback
// when its Step.Wait is zero.
const CallbackWaitDefault = 24 * time.Hour

// CallbackWaitMax bounds Step.Wait: a wait past it is more likely a unit
// mistake than a callback anyone still expects.
const CallbackWaitMax = 90 * 24 * time.Hour

// Definition is a named, ordered list of steps. Build one with New; it is
// immutable afterwards and safe for concurrent use.
type Definition struct {
	name  string
	steps []Step
	index map[string]int
	// input is the declared input type (WithInput), nil for any JSON.
	input *inputType
	// described is set on a definition rebuilt from a Description: it has
	// no handlers, so it can start and repair sagas but not run steps.
	described bool
	// inputName and inputFields are the described input type's name and
	// members.
	inputName   string
	inputFields []string
	// signed says callbacks must carry a signature (WithCallbackSecrets);
	// secrets are the keys that check it, none in a definition rebuilt
	// from its description, which then refuses every callback.
	signed  bool
	secrets [][]byte
	// deadline is the time a saga has to finish (WithDeadline), 0 for
	// none.
	deadline time.Duration

	// version is the definition's version (WithVersion), 1 unless set.
	version int
	// grouped says a step is a branch of a parallel group.
	grouped bool

	// schedule starts its sagas at the ticks of a cron expression
	// (WithSchedule), nil for none; events starts them from the messages
	// of a NATS subject (WithEvents), nil for none.
	schedule *Schedule
	events   *Events

	// children are the ChildSteps' children, by step index; depth is how
	// deep they nest below this definition (0 for none), tree the names
	// of every definition below it.
	children map[int]child
	depth    int
	tree     map[string]bool
}

var namePattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// New validates and returns a definition. The error wraps
// ErrInvalidDefinition and names the offending field.
func New(name string, steps ...Step) (*Definition, error) {
	return build(name, steps, false)
}

func build(name string, steps []Step, described bool) (*Definition, error) {
	return buildWith(name, steps, described, nil)
}

// buildWith is build; childRefs are a described definition's children,
// as "name@version" by step index.
func buildWith(name string, steps []Step, described bool, childRefs map[int]string) (*Definition, error) {
	bad := func(field, format string, args ...any) error {
		return &DefinitionError{Definition: name, Field: field, Problem: fmt.Sprintf(format, args...)}
	}
	if !namePattern.MatchString(name) {
		return nil, bad("name", "must be 1 to 64 letters, digits, '_' or '-'")
	}
	if len(steps) == 0 {
		return nil, bad("steps", "a saga needs at least one step")
	}
	d := &Definition{name: name, version: 1, index: make(map[string]int, len(steps)), described: described}
	if problem, field := checkGroups(steps); problem != "" {
		return nil, bad(field, "%s", problem)
	}
	reached := map[State]string{}
	all := make(map[string]int, len(steps))
	for i, s := range steps {
		if _, dup := all[s.Name]; !dup {
			all[s.Name] = i
		}
	}
	for i, s := range steps {
		field := fmt.Sprintf("steps[%d]", i)
		if !namePattern.MatchString(s.Name) {
			return nil, bad(field+".Name", "%q must be 1 to 64 letters, digits, '_' or '-'", s.Name)
		}
		if _, dup := d.index[s.Name]; dup {
			return nil, bad(field+".Name", "step name %q is used twice", s.Name)
		}
		if s.Reaches == "" {
			return nil, bad(field+".Reaches", "step %q must name the state the saga reaches", s.Name)
		}
		if !namePattern.MatchString(string(s.Reaches)) {
			return nil, bad(field+".Reaches", "%q must be 1 to 64 letters, digits, '_' or '-'", s.Reaches)
		}
		if reservedState(s.Reaches) {
			return nil, bad(field+".Reaches", "%q is a built-in state; pick another name", s.Reaches)
		}
		if other, dup := reached[s.Reaches]; dup && (s.Group == "" || steps[i-1].Group != s.Group) {
			return nil, bad(field+".Reaches", "state %q is already reached by step %q", s.Reaches, other)
		}
		if s.Kind != DatabaseStep && s.Kind != ExternalStep && s.Kind != CallbackStep && s.Kind != ChildStep {
			return nil, bad(field+".Kind", "step %q must say how it takes effect: saga.DatabaseStep (its writes go through sc.Tx), saga.ExternalStep (it calls another system with sc.Key), saga.CallbackStep (it sends a request and waits for the other system's callback) or saga.ChildStep (it runs another definition as a child saga)", s.Name)
		}
		waits := s.Kind == CallbackStep || s.Kind == ChildStep
		if problem, f := d.checkChild(i, &s, described, childRefs[i]); problem != "" {
			return nil, bad(field+"."+f, "%s", problem)
		}
		switch {
		case s.Kind == DatabaseStep && s.Verify != nil:
			return nil, bad(field+".Verify", "step %q is a database step: its outcome is never unknown (remove Verify)", s.Name)
		case s.Kind != CallbackStep && s.CheckCallback != nil:
			return nil, bad(field+".CheckCallback", "step %q is a %s step; only a saga.CallbackStep takes callbacks (remove CheckCallback)", s.Name, s.Kind)
		case !waits && s.Wait != 0:
			return nil, bad(field+".Wait", "step %q is a %s step; only a saga.CallbackStep or a saga.ChildStep waits (remove Wait)", s.Name, s.Kind)
		case waits && s.Wait == 0:
			s.Wait = CallbackWaitDefault
		case waits && (s.Wait < time.Second || s.Wait > CallbackWaitMax):
			return nil, bad(field+".Wait", "step %q waits %s; give between 1s and %s", s.Name, s.Wait, CallbackWaitMax)
		}
		if problem := d.checkCondition(i, steps, all); problem != "" {
			return nil, bad(field+".When", "%s", problem)
		}
		limit, problem := s.Limit.withDefaults(name, s.Name, s.Kind)
		if problem != "" {
			return nil, bad(field+".Limit", "%s", problem)
		}
		s.Limit = limit
		if s.Forward == nil && !described && s.Kind != ChildStep {
			return nil, bad(field+".Forward", "step %q has no forward handler", s.Name)
		}
		if err := s.Retry.validate(); err != nil {
			return nil, bad(field+".Retry", "%v", err)
		}
		if err := s.CompensateRetry.validate(); err != nil {
			return nil, bad(field+".CompensateRetry", "%v", err)
		}
		s.Retry = s.Retry.WithDefaults()
		s.CompensateRetry = s.CompensateRetry.WithDefaults()
		reached[s.Reaches] = s.Name
		d.grouped = d.grouped || s.Group != ""
		d.index[s.Name] = i
		d.steps = append(d.steps, s)
	}
	return d, nil
}

// MustNew is New that panics on an invalid definition, for package-level
// variables.
func MustNew(name string, steps ...Step) *Definition {
	d, err := New(name, steps...)
	if err != nil {
		panic(err)
	}
	return d
}

// Name returns the definition's name.
func (d *Definition) Name() string { return d.name }

// Version returns the definition's version: 1 unless set with WithVersion.
func (d *Definition) Version() int { return d.version }

// WithVersion returns a copy of d at the given version, a positive
// number. A saga runs the steps of the version it started with, to its
// end; a new version of a definition is a new definition under the same
// name, which new sagas take while sagas of older versions finish on
// theirs. Keep an older version in the build (under the same name, at its
// own version) while sagas of it run, or run a worker with the older build
// beside the new one. It panics on a version below 1, as MustNew does on an
// invalid definition: versions are constants of the code.
//
//	var transferV2 = saga.WithVersion(saga.MustNew("transfer", steps...), 2)
func WithVersion(d *Definition, version int) *Definition {
	if version < 1 {
		panic(&DefinitionError{Definition: d.name, Field: "version", Problem: fmt.Sprintf("is %d; versions start at 1", version)})
	}
	c := *d
	c.version = version
	return &c
}

// Ref returns the definition's name and version as "name@version", as
// logs, metrics of dead letters and the workers table name them.
func (d *Definition) Ref() string { return Ref(d.name, d.version) }

// Ref names version of a definition as "name@version"; a version below 1
// is version 1, the version of a definition built without WithVersion.
func Ref(name string, version int) string { return fmt.Sprintf("%s@%d", name, max(version, 1)) }

// Len returns the number of steps.
func (d *Definition) Len() int { return len(d.steps) }

// Step returns the i-th step, with retry defaults applied.
func (d *Definition) Step(i int) Step { return d.steps[i] }

// StepIndex returns the position of the named step, or -1.
func (d *Definition) StepIndex(name string) int {
	if i, ok := d.index[name]; ok {
		return i
	}
	return -1
}

// Steps returns a copy of the steps in order.
func (d *Definition) Steps() []Step { return append([]Step(nil), d.steps...) }

// FinalState is the state of a saga whose every step succeeded.
func (d *Definition) FinalState() State { return d.steps[len(d.steps)-1].Reaches }

// StateBefore returns the state a saga is in while step i runs forward:
// StateInit for the first step, else the state reached by step i-1.
func (d *Definition) StateBefore(i int) State {
	first, _ := d.Group(i)
	if first == 0 {
		return StateInit
	}
	return d.steps[first-1].Reaches
}

// IsTerminal reports whether s ends a saga of this definition: its final
// state, StateCompensated, one of the two that need a person,
// StateFailed and StateParked, or StateClosed.
func (d *Definition) IsTerminal(s State) bool {
	return s == d.FinalState() || s == StateCompensated || s == StateFailed || s == StateParked || s == StateClosed
}

// ValidState reports whether s is a state a saga of this definition can be in.
func (d *Definition) ValidState(s State) bool {
	if reservedState(s) {
		return true
	}
	for _, st := range d.steps {
		if st.Reaches == s {
			return true
		}
	}
	return false
}

// CanTransition reports whether the saga may move from one state to
// another. Moves go one way: forward through the steps' states in order
// (past the states of steps skipped on the way, see Condition),
// from any non-terminal state to StateCompensating, from StateCompensating
// to StateCompensated or StateFailed, and from a forward state (one that
// is not StateCompensating) to StateParked. Nothing leaves a terminal
// state (an operator's repair, such as Client.Retry, is not a transition).
func (d *Definition) CanTransition(from, to State) bool {
	if !d.ValidState(from) || !d.ValidState(to) || d.IsTerminal(from) {
		return false
	}
	switch to {
	case StateInit, StateClosed:
		// Only an operator's Client.Close reaches StateClosed.
		return false
	case StateCompensating, StateParked:
		return from != StateCompensating
	case StateCompensated, StateFailed:
		return from == StateCompensating
	}
	if from == StateCompensating {
		return false
	}
	// to is a step state: a later one, past conditional steps only.
	next := 0
	if from != StateInit {
		for i, st := range d.steps {
			if st.Reaches == from {
				next = i + 1
			}
		}
	}
	if next >= len(d.steps) {
		return false
	}
	if d.steps[next].Reaches == to {
		return true
	}
	for _, k := d.Group(next); k < len(d.steps) && d.skippable(k); _, k = d.Group(k) {
		if d.steps[k].Reaches == to {
			return true
		}
	}
	return false
}
