package attempt

import (
	"context"
	"errors"
	"sync"

	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// FaultKind is a fault the test kit (package sagatest) injects into one
// engine's attempts.
type FaultKind int

const (
	// LoseOutcome: the attempt takes effect, and its outcome is lost: an
	// external step's call returns and the worker dies before recording
	// it (the attempt is unknown); a database step's transaction commits
	// and the worker dies before anything else (as CrashAfterCommit).
	LoseOutcome FaultKind = iota + 1
	// CrashAfterCommit: the attempt's outcome commits, and the worker dies
	// before it acknowledges the command, publishes what it committed or
	// runs the next step.
	CrashAfterCommit
	// DeliverTwice: another copy of the command is delivered at once, to
	// a runner that shares nothing in memory with this one.
	DeliverTwice
	// LateForward: once a step's compensation succeeded, its forward
	// request arrives late, under the forward key (a request a proxy held,
	// a slow first attempt). The fault matches the forward phase.
	LateForward
)

// ErrCrashed is what an attempt returns where the test kit made its
// worker die: nothing after that point happened.
var ErrCrashed = errors.New("attempt: the worker crashed here (a fault injected by the test kit)")

// Fault selects the attempts a fault hits.
type Fault struct {
	Kind FaultKind
	// Definition and Step name the step; empty matches any.
	Definition, Step string
	// Phase is the step's phase; empty matches the forward phase.
	Phase saga.Phase
	// Attempt is the attempt number; 0 matches any.
	Attempt int
	// Times is how many attempts it hits; 0 means once.
	Times int
}

// Faults holds the faults of one engine. A nil *Faults injects nothing.
type Faults struct {
	mu    sync.Mutex
	rules []*Fault
	fired map[FaultKind]int
	// Duplicate delivers a copy of cmd (DeliverTwice); set by the engine.
	Duplicate func(cmd wire.Command)
}

// Add arms a fault.
func (f *Faults) Add(fault Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fault.Phase == "" {
		fault.Phase = saga.PhaseForward
	}
	if fault.Times <= 0 {
		fault.Times = 1
	}
	f.rules = append(f.rules, &fault)
}

// Fired returns how often faults of kind hit an attempt.
func (f *Faults) Fired(kind FaultKind) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fired[kind]
}

// take reports whether a fault of kind hits cmd, using it up.
func (f *Faults) take(kind FaultKind, cmd wire.Command) bool {
	if f == nil {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, r := range f.rules {
		if r.Kind != kind || r.Times == 0 || (r.Definition != "" && r.Definition != cmd.Definition) ||
			(r.Step != "" && r.Step != cmd.Step) || r.Phase != cmd.Phase || (r.Attempt != 0 && r.Attempt != cmd.Attempt) {
			continue
		}
		r.Times--
		if f.fired == nil {
			f.fired = map[FaultKind]int{}
		}
		f.fired[kind]++
		return true
	}
	return false
}

// lateForward delivers, when the test kit's LateForward fault hits it,
// the forward request of a step whose compensation just succeeded: a
// database step's command, which its key's inbox record answers; an
// external or callback step's call, made by its handler under the forward
// key as a request held on the way would arrive. Its outcome reaches no
// one, as a late request's does not: the other system must refuse it.
func (r *Runner) lateForward(ctx context.Context, a *attempt) {
	fwd := a.cmd
	fwd.Phase, fwd.Key, fwd.Attempt = saga.PhaseForward, saga.StepKey(fwd.SagaID, fwd.Step, saga.PhaseForward), 1
	if !r.faults.take(LateForward, fwd) {
		return
	}
	if a.step.Kind == saga.DatabaseStep {
		_, err := r.Handle(ctx, fwd, true)
		r.cfg.Logger.Info("test kit: a late forward command was delivered", "saga_id", fwd.SagaID, "step", fwd.Step, "error", err)
		return
	}
	cctx, cancel := context.WithTimeout(ctx, a.step.Retry.Timeout)
	defer cancel()
	late := &attempt{r: r, cmd: fwd, def: a.def, step: a.step}
	sc, err := late.context(nil, nil)
	if err == nil {
		_, err = invoke(cctx, a.step.Forward, sc)
	}
	r.cfg.Logger.Info("test kit: a late forward request was made", "saga_id", fwd.SagaID, "step", fwd.Step, "error", err)
}

// Twin returns a runner of r's configuration that shares nothing in
// memory with it (no recent answers, no slots, no eager runs): the
// worker that the test kit's DeliverTwice delivers its copies to.
func (r *Runner) Twin() (*Runner, error) {
	cfg := r.cfg
	cfg.Recent, cfg.Slots, cfg.Eager = 0, 0, false
	return New(cfg)
}
