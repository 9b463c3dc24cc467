package sagatest

import (
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/saga"
)

// FaultKind is a fault the kit injects into the engine's attempts.
type FaultKind int

const (
	// LoseOutcome: the attempt takes effect, then its outcome is lost.
	// An external step's call returns and the worker dies before
	// recording it: the attempt's outcome is unknown, its lease runs out,
	// and the next attempt calls again with the same step key. A
	// database step's transaction commits and the worker dies at once
	// after (as CrashAfterCommit).
	LoseOutcome FaultKind = iota + 1
	// CrashAfterCommit: the attempt's outcome commits, then the worker
	// dies before acknowledging the command, publishing what it committed
	// or running the next step. Redelivery, the outbox relay and lease
	// expiry carry the saga on.
	CrashAfterCommit
	// DeliverTwice: a second copy of the command is delivered at once to
	// a worker that shares nothing in memory with the first, so the
	// database alone decides which copy takes effect.
	DeliverTwice
	// LateForward: once the step's compensation succeeded, its forward
	// request arrives late, under the forward key: a request a proxy
	// held, or a slow first attempt. A database step's command is
	// answered by its key's record; an external or callback step's
	// handler runs once more, and the other system must refuse it (a
	// compensation that closes the door voids the key). Its outcome
	// reaches no one. Step names the step; the phase is the forward one.
	LateForward
)

// Fault selects the attempts a fault hits.
type Fault struct {
	Kind FaultKind
	// Step names the step; empty hits any.
	Step string
	// Phase is saga.PhaseForward (the default) or saga.PhaseCompensate.
	Phase saga.Phase
	// Attempt is the attempt number; 0 hits any.
	Attempt int
	// Times is how many attempts it hits; 0 means once.
	Times int
}

var kinds = map[FaultKind]attempt.FaultKind{
	LoseOutcome: attempt.LoseOutcome, CrashAfterCommit: attempt.CrashAfterCommit, DeliverTwice: attempt.DeliverTwice,
	LateForward: attempt.LateForward,
}

// Inject arms a fault for the attempts to come.
func (e *Env) Inject(f Fault) {
	e.faults.Add(attempt.Fault{Kind: kinds[f.Kind], Step: f.Step, Phase: f.Phase, Attempt: f.Attempt, Times: f.Times})
}

// Fired returns how many attempts faults of kind hit so far.
func (e *Env) Fired(kind FaultKind) int { return e.faults.Fired(kinds[kind]) }
