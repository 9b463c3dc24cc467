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
	Error      string                     `json:"error,omitempty"`
	CreatedAt  time.Time                  `json:"created_at"`
	UpdatedAt  time.Time                  `json:"updated_at"`
	FinishedAt *time.Time                 `json:"finished_at,omitempty"`
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
	Step    string     `json:"step"`
	Phase   Phase      `json:"phase"`
	Index   int        `json:"index"`
	Key     uuid.UUID  `json:"key"`
	Kind    string     `json:"kind"`
	Status  StepStatus `json:"status"`
	Attempt int        `json:"attempt"`
	// PossiblyDone is set when some attempt's outcome at another system is
	// unknown: the step may have taken effect whatever its status says.
	PossiblyDone  bool            `json:"possibly_done,omitempty"`
	LeaseUntil    *time.Time      `json:"lease_until,omitempty"`
	NextAttemptAt *time.Time      `json:"next_attempt_at,omitempty"`
	LastError     string          `json:"last_error,omitempty"`
	Result        json.RawMessage `json:"result,omitempty"`
	CreatedAt     time.Time       `json:"created_at"`
	UpdatedAt     time.Time       `json:"updated_at"`
}
