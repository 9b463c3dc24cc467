package saga

import (
	"encoding/json"
	"time"

	"github.com/google/uuid"
)

// Instance is a saga as stored: what Start returns and what inspection
// reads.
type Instance struct {
	ID         uuid.UUID                  `json:"id"`
	Definition string                     `json:"definition"`
	Key        string                     `json:"key"`
	State      State                      `json:"state"`
	Version    int64                      `json:"version"`
	Input      json.RawMessage            `json:"input"`
	Results    map[string]json.RawMessage `json:"results,omitempty"`
	// Skipped names the conditional steps the saga skipped, in order:
	// decided once, never compensated (Condition).
	Skipped    []string   `json:"skipped,omitempty"`
	Error      string     `json:"error,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// Paused is set while the saga is held by a pause (its own or its
	// definition's), filled by inspection calls only.
	Paused *Pause `json:"paused,omitempty"`
	// DeadlineAt is when the saga is cancelled if it has not finished
	// (its definition's deadline), filled by inspection calls only.
	DeadlineAt *time.Time `json:"deadline_at,omitempty"`
	// Steps lists the step executions, filled by inspection calls only.
	Steps []StepExecution `json:"steps,omitempty"`
	// Attempts is the timeline: every attempt of every step execution in
	// dispatch order, filled by inspection calls only.
	Attempts []StepAttempt `json:"attempts,omitempty"`
	// Callbacks lists the callbacks received for the saga's callback
	// steps, filled by inspection calls only.
	Callbacks []CallbackRecord `json:"callbacks,omitempty"`
	// Repairs lists the operators' repairs of the saga, oldest first,
	// filled by inspection calls only.
	Repairs []RepairRecord `json:"repairs,omitempty"`
	// DefinitionVersion is the version of the definition the saga runs,
	// the one it started with.
	DefinitionVersion int `json:"definition_version"`
	// DeadLetters are the saga's commands parked because no worker that
	// received them knew their definition, version or step, filled by
	// inspection calls only.
	DeadLetters []DeadLetter `json:"dead_letters,omitempty"`
	// Parent is the saga whose ChildStep ParentStep started this one, nil
	// for a saga started otherwise.
	Parent     *uuid.UUID `json:"parent,omitempty"`
	ParentStep string     `json:"parent_step,omitempty"`
	// Children are the sagas the saga's ChildSteps started, filled by
	// inspection calls only.
	Children []ChildRecord `json:"children,omitempty"`
}

// ChildRecord is a child saga as its parent's inspection shows it.
type ChildRecord struct {
	// Step is the parent's ChildStep that started it.
	Step       string    `json:"step"`
	ID         uuid.UUID `json:"id"`
	Definition string    `json:"definition"`
	State      State     `json:"state"`
}

// CallbackRecord is one callback received for a CallbackStep, as stored
// under its event id.
type CallbackRecord struct {
	Step    string `json:"step"`
	EventID string `json:"event_id"`
	// Outcome is what the callback did: applied (it completed the step),
	// pending (it came before the step's request was recorded, and is
	// applied when the step waits), late (the step was not waiting any
	// more: given up, compensated or cancelled) or superseded (another
	// event completed the step first).
	Outcome string `json:"outcome"`
	// Failed is set for a callback that reported the request refused.
	Failed     bool            `json:"failed,omitempty"`
	Result     json.RawMessage `json:"result,omitempty"`
	Error      string          `json:"error,omitempty"`
	ReceivedAt time.Time       `json:"received_at"`
	AppliedAt  *time.Time      `json:"applied_at,omitempty"`
}

// RepairRecord is one operator's repair of a saga (retry, cancel, skip,
// close, pause, resume), as recorded in the repair's own transaction.
type RepairRecord struct {
	// Operation is the repair's name: retry, cancel, skip, close, pause
	// or resume.
	Operation string `json:"operation"`
	// Key is the request's key: the same request sent again under it
	// changed nothing.
	Key string `json:"key"`
	// Reason says why, as the operator gave it.
	Reason string `json:"reason,omitempty"`
	// By names who asked, as the operator's tool gave it.
	By string `json:"by,omitempty"`
	// Step and Phase name the step a skip marked succeeded; empty for
	// the other repairs.
	Step  string `json:"step,omitempty"`
	Phase Phase  `json:"phase,omitempty"`
	// StateAfter is the saga's state right after the repair committed.
	StateAfter State `json:"state_after"`
	// At is when the repair's transaction began, on the database clock.
	At time.Time `json:"at"`
}

// Pause says why a saga is held: no attempt of its steps starts until it
// is resumed.
type Pause struct {
	// Since is when the pause committed, on the database clock.
	Since time.Time `json:"since"`
	// Definition is set when the saga is held by its definition's pause
	// rather than its own.
	Definition string `json:"definition,omitempty"`
}

// DeadLetter is a command parked in the dead-letter table: it was
// delivered a bounded number of times to workers that do not know its
// definition, version or step (a rolling deploy, a worker missing a
// definition). A worker that knows it sends it again when it runs; a
// person can send it again or drop it.
type DeadLetter struct {
	ID                int64     `json:"id"`
	SagaID            uuid.UUID `json:"saga_id"`
	Definition        string    `json:"definition"`
	DefinitionVersion int       `json:"definition_version"`
	Step              string    `json:"step"`
	Phase             Phase     `json:"phase"`
	Attempt           int       `json:"attempt"`
	Subject           string    `json:"subject"`
	MsgID             string    `json:"msg_id"`
	// Reason says what the last worker that received it did not know.
	Reason string `json:"reason"`
	// Deliveries is how many times the broker delivered it before it
	// was parked.
	Deliveries int       `json:"deliveries"`
	ParkedBy   string    `json:"parked_by"`
	FirstSeen  time.Time `json:"first_seen"`
	LastSeen   time.Time `json:"last_seen"`
}

// StepAttempt is one attempt of one step execution.
type StepAttempt struct {
	Step         string     `json:"step"`
	Phase        Phase      `json:"phase"`
	Attempt      int        `json:"attempt"`
	Key          uuid.UUID  `json:"key"`
	DispatchedAt time.Time  `json:"dispatched_at"`
	FinishedAt   *time.Time `json:"finished_at,omitempty"`
	// Outcome is succeeded, failed, retry, unknown (an external call whose
	// result was lost: it may have taken effect) or lease expired; empty
	// while the attempt is in flight.
	Outcome string `json:"outcome,omitempty"`
	Error   string `json:"error,omitempty"`
}

// Finished reports whether the saga reached a terminal state.
func (i *Instance) Finished() bool { return i.FinishedAt != nil }

// StepExecution is one (saga, step, phase) row.
type StepExecution struct {
	Step  string    `json:"step"`
	Phase Phase     `json:"phase"`
	Index int       `json:"index"`
	Key   uuid.UUID `json:"key"`
	Kind  string    `json:"kind"`
	// Group is the step's parallel group (Step.Group), empty for none:
	// the steps of a group run side by side.
	Group   string     `json:"group,omitempty"`
	Status  StepStatus `json:"status"`
	Attempt int        `json:"attempt"`
	// PossiblyDone is set when some attempt's outcome at another system is
	// unknown: the step may have taken effect whatever its status says.
	PossiblyDone bool `json:"possibly_done,omitempty"`
	// CallbackToken is a callback step's token (CallbackToken), for the
	// other system's callback; empty for other steps.
	CallbackToken string          `json:"callback_token,omitempty"`
	LeaseUntil    *time.Time      `json:"lease_until,omitempty"`
	NextAttemptAt *time.Time      `json:"next_attempt_at,omitempty"`
	LastError     string          `json:"last_error,omitempty"`
	Result        json.RawMessage `json:"result,omitempty"`
	CreatedAt     time.Time       `json:"created_at"`
	UpdatedAt     time.Time       `json:"updated_at"`
}
