// Package failpoint holds named fault-injection points compiled into the
// engine. They are inert until enabled (one atomic load when off) and are
// switched on from tests, or in the worker binary by the IDEMSAGA_FAILPOINTS
// environment variable.
//
// A spec is a list separated by ';' of name=action, where action is one of
//
//	exit          exit the process at once with code ExitCode (a crash:
//	              no deferred function runs, open transactions die)
//	panic         panic
//	error         return an error from the point
//	sleep(250ms)  sleep, then go on
//
// optionally followed by *N (fire only the first N times) and/or @P (fire
// with probability P, 0 < P <= 1). Example:
//
//	IDEMSAGA_FAILPOINTS='step-after-inbox=exit*1;relay-before-mark=error@0.1'
package failpoint

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// EnvVar names the environment variable the worker binary reads.
const EnvVar = "IDEMSAGA_FAILPOINTS"

// ExitCode is the exit status of an "exit" action.
const ExitCode = 86

// The failpoints compiled into the engine.
const (
	// StepAfterInbox fires in a step worker after the step's claim: for a
	// database step, after the inbox insert and before the business
	// write; for an external step, after its claim committed and before
	// the call.
	StepAfterInbox = "step-after-inbox"
	// StepAfterCall fires in a step worker after an external step's call
	// returned and before its outcome is recorded: the call may have
	// taken effect, and a crash here leaves its outcome unknown.
	StepAfterCall = "step-after-call"
	// StepBeforeAck fires after the step transaction commits and before
	// the command is acknowledged.
	StepBeforeAck = "step-before-ack"
	// StepRedeliver fires after the step transaction commits, on a
	// command's first delivery, in place of the ack: the command is
	// Nak'd, and JetStream delivers it again at once, as it would after
	// AckWait had the ack been lost ("error" action; worker bench
	// --lost-acks).
	StepRedeliver = "step-redeliver"
	// OrchestratorBeforeAck fires after the orchestrator's transaction
	// commits and before the reply is acknowledged.
	OrchestratorBeforeAck = "orchestrator-before-ack"
	// RelayBeforeMark fires after the broker acknowledged a batch and
	// before the outbox rows are marked published.
	RelayBeforeMark = "relay-before-mark"
	// StartAfterCommit fires after a saga's start transaction commits and
	// before the caller gets its answer.
	StartAfterCommit = "start-after-commit"
	// LeaseTakeover fires inside a lease takeover, after the new attempt
	// is written and before it commits.
	LeaseTakeover = "lease-takeover"
)

// Names lists every failpoint.
var Names = []string{StepAfterInbox, StepAfterCall, StepBeforeAck, StepRedeliver, OrchestratorBeforeAck, RelayBeforeMark, StartAfterCommit, LeaseTakeover}

// ErrInjected is what an "error" action returns.
var ErrInjected = errors.New("failpoint: injected error")

type kind int

const (
	kindExit kind = iota
	kindPanic
	kindError
	kindSleep
)

type action struct {
	kind      kind
	sleep     time.Duration
	prob      float64
	limited   bool
	remaining atomic.Int64
	hits      atomic.Int64
}

var (
	enabled atomic.Bool
	mu      sync.RWMutex
	points  = map[string]*action{}
	// exit is replaced in tests.
	exit   = os.Exit
	osExit = os.Exit
)

// Inject runs the action set for name, if any. It returns ErrInjected
// (wrapped with the name) for an "error" action, and nil otherwise.
func Inject(name string) error {
	if !enabled.Load() {
		return nil
	}
	return inject(name)
}

func inject(name string) error {
	mu.RLock()
	a := points[name]
	mu.RUnlock()
	if a == nil {
		return nil
	}
	if a.prob < 1 && rand.Float64() >= a.prob {
		return nil
	}
	if a.limited && a.remaining.Add(-1) < 0 {
		return nil
	}
	a.hits.Add(1)
	switch a.kind {
	case kindExit:
		fmt.Fprintf(os.Stderr, "failpoint %s: exiting with code %d\n", name, ExitCode)
		exit(ExitCode)
	case kindPanic:
		panic("failpoint " + name)
	case kindError:
		return fmt.Errorf("%w at %s", ErrInjected, name)
	case kindSleep:
		time.Sleep(a.sleep)
	}
	return nil
}

// Hits reports how many times name fired since it was enabled.
func Hits(name string) int64 {
	mu.RLock()
	defer mu.RUnlock()
	if a := points[name]; a != nil {
		return a.hits.Load()
	}
	return 0
}

// Enable parses spec and switches its failpoints on, replacing any set
// before. An empty spec disables everything. Nothing changes on error.
func Enable(spec string) error {
	parsed := map[string]*action{}
	for _, part := range strings.Split(spec, ";") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, act, ok := strings.Cut(part, "=")
		name, act = strings.TrimSpace(name), strings.TrimSpace(act)
		if !ok || name == "" || act == "" {
			return fmt.Errorf("failpoint: %q is not name=action", part)
		}
		if !slices.Contains(Names, name) {
			return fmt.Errorf("failpoint: unknown failpoint %q; known: %s", name, strings.Join(Names, ", "))
		}
		a, err := parseAction(act)
		if err != nil {
			return fmt.Errorf("failpoint %s: %w", name, err)
		}
		parsed[name] = a
	}
	mu.Lock()
	points = parsed
	mu.Unlock()
	enabled.Store(len(parsed) > 0)
	return nil
}

// Disable switches every failpoint off.
func Disable() { _ = Enable("") }

// FromEnv enables the failpoints named in IDEMSAGA_FAILPOINTS, if set.
func FromEnv() error {
	if spec := os.Getenv(EnvVar); spec != "" {
		if err := Enable(spec); err != nil {
			return fmt.Errorf("%s: %w", EnvVar, err)
		}
	}
	return nil
}

func parseAction(s string) (*action, error) {
	a := &action{prob: 1}
	if i := strings.LastIndexByte(s, '@'); i >= 0 {
		p, err := strconv.ParseFloat(s[i+1:], 64)
		if err != nil || p <= 0 || p > 1 {
			return nil, fmt.Errorf("probability %q must be in (0, 1]", s[i+1:])
		}
		a.prob, s = p, s[:i]
	}
	if i := strings.LastIndexByte(s, '*'); i >= 0 {
		n, err := strconv.Atoi(s[i+1:])
		if err != nil || n < 1 {
			return nil, fmt.Errorf("count %q must be a positive integer", s[i+1:])
		}
		a.limited = true
		a.remaining.Store(int64(n))
		s = s[:i]
	}
	switch {
	case s == "exit":
		a.kind = kindExit
	case s == "panic":
		a.kind = kindPanic
	case s == "error":
		a.kind = kindError
	case strings.HasPrefix(s, "sleep(") && strings.HasSuffix(s, ")"):
		d, err := time.ParseDuration(s[len("sleep(") : len(s)-1])
		if err != nil || d < 0 {
			return nil, fmt.Errorf("sleep duration in %q: use a Go duration such as 250ms", s)
		}
		a.kind, a.sleep = kindSleep, d
	default:
		return nil, fmt.Errorf("unknown action %q; use exit, panic, error or sleep(duration)", s)
	}
	return a, nil
}
