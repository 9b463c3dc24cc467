package saga

// State is the name of a saga's state. The engine moves a saga one way along
// a directed acyclic graph: StateInit, then the state reached by each step in
// order; on failure StateCompensating then StateCompensated, or StateFailed
// when compensation cannot finish; StateParked when a step that may have
// taken effect cannot be undone; StateClosed when an operator closed a
// failed or parked saga as handled.
type State string

// Built-in states every saga can be in.
const (
	// StateInit is the state of a saga whose first step has not completed.
	StateInit State = "init"
	// StateCompensating is the state while completed steps are being undone.
	StateCompensating State = "compensating"
	// StateCompensated is terminal: every completed step was undone.
	StateCompensated State = "compensated"
	// StateFailed is terminal and needs a person: compensation could not
	// finish. The saga's error says which step and why.
	StateFailed State = "failed"
	// StateParked is terminal and needs a person: a forward step was given
	// up while possibly done (an attempt's outcome at another system is
	// unknown) and has no compensation, so nothing was undone. The saga's
	// error names the step and its key: check the other system under that
	// key, then retry the step (Client.Retry, or the runtime's `retry` command), skip it
	// with its result if it did take effect (Client.Skip, `skip`),
	// cancel the saga if it did not (Client.Cancel), or close the saga as
	// handled (Client.Close, `close`).
	StateParked State = "parked"
	// StateClosed is terminal: an operator closed a failed or parked saga
	// as handled (Client.Close), with who and why in its repairs. Nothing
	// runs for it any more.
	StateClosed State = "closed"
)

func reservedState(s State) bool {
	switch s {
	case StateInit, StateCompensating, StateCompensated, StateFailed, StateParked, StateClosed:
		return true
	}
	return false
}

// Phase tells a step's forward action from its compensation.
type Phase string

// The two phases of a step.
const (
	PhaseForward    Phase = "forward"
	PhaseCompensate Phase = "compensate"
)

// Valid reports whether p is one of the two phases.
func (p Phase) Valid() bool { return p == PhaseForward || p == PhaseCompensate }

// StepStatus is the status of one step execution (saga, step, phase).
type StepStatus string

// Step execution statuses.
const (
	// StepDispatched: a command is out and its lease is running.
	StepDispatched StepStatus = "dispatched"
	// StepRetrying: the last attempt failed; the next one is due at a
	// durable time.
	StepRetrying StepStatus = "retrying"
	// StepWaiting: a CallbackStep's request was accepted, and the step
	// waits for the other system's callback until its lease (the wait's
	// deadline).
	StepWaiting StepStatus = "waiting"
	// StepSucceeded is terminal.
	StepSucceeded StepStatus = "succeeded"
	// StepFailed is terminal: a permanent error, retries exhausted, or a
	// last attempt whose outcome stayed unknown (then the step is possibly
	// done, StepExecution.PossiblyDone).
	StepFailed StepStatus = "failed"
	// StepSkipped is a conditional step its condition skipped
	// (Instance.Skipped): it has no key and no attempt. Only inspection
	// shows it.
	StepSkipped StepStatus = "skipped"
)
