package attempt

import (
	"bytes"
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/idemsaga/idemsaga/internal/wire"
)

// recent is what a worker knows of attempts in memory: those it answered
// (the outcomes the inbox holds, last used first out), and those it is
// running now. Another delivery of an attempt it runs waits for that run
// here, then takes its answer, instead of waiting on the inbox key in the
// database and reading the answer there. It is a fast path only: an
// attempt it does not know goes to the inbox, the guarantee.
type recent struct {
	answered *lru.Cache[attemptKey, answer]
	mu       sync.Mutex
	// running holds, per attempt running here, a channel closed when its
	// run ends.
	running map[attemptKey]chan struct{}
	// waiting counts the deliveries waiting for a run here (Waiting).
	waiting atomic.Int64
}

// attemptKey names one attempt of a step.
type attemptKey struct {
	key     uuid.UUID
	attempt int
}

// answer is what the inbox holds for an attempt the worker answered.
type answer struct {
	outcome wire.Outcome
	result  json.RawMessage
	errText string
}

// maxRemembered bounds the result and error an answer keeps; a larger
// answer is not remembered, and its duplicates go to the inbox.
const maxRemembered = 1024

func newRecent(size int) (*recent, error) {
	answered, err := lru.New[attemptKey, answer](size)
	if err != nil {
		return nil, err
	}
	return &recent{answered: answered, running: map[attemptKey]chan struct{}{}}, nil
}

// await returns the answer this worker remembers for cmd's attempt, if
// any, after waiting for a run of the same attempt in progress here.
// Otherwise cmd's run is registered as the attempt's, and release, to be
// called when the run ended (after remember), lets the deliveries waiting
// for it go on. An error means ctx ended while waiting.
func (rn *Runner) await(ctx context.Context, cmd wire.Command) (a answer, ok bool, release func(), err error) {
	r := rn.recent
	if r == nil {
		return answer{}, false, func() {}, nil
	}
	k := attemptKey{cmd.Key, cmd.Attempt}
	for {
		if a, ok := r.answered.Get(k); ok {
			return a, true, nil, nil
		}
		r.mu.Lock()
		wait, running := r.running[k]
		if !running {
			// A run may have ended between the look-up and the lock.
			if a, ok := r.answered.Get(k); ok {
				r.mu.Unlock()
				return a, true, nil, nil
			}
			done := make(chan struct{})
			r.running[k] = done
			r.mu.Unlock()
			return answer{}, false, func() {
				r.mu.Lock()
				delete(r.running, k)
				r.mu.Unlock()
				close(done)
			}, nil
		}
		r.waiting.Add(1)
		r.mu.Unlock()
		// The run ends with an answer remembered, or none (an error that
		// left nothing committed, an external call's retry): then this
		// delivery goes to the inbox, which decides.
		select {
		case <-wait:
			r.waiting.Add(-1)
		case <-ctx.Done():
			r.waiting.Add(-1)
			return answer{}, false, nil, ctx.Err()
		}
	}
}

// Waiting returns how many deliveries wait in memory for a run of their
// attempt in progress here.
func (rn *Runner) Waiting() int {
	if rn.recent == nil {
		return 0
	}
	return int(rn.recent.waiting.Load())
}

// remember keeps an answered attempt whose outcome (or, for a database
// step, whose end) the inbox holds.
func (rn *Runner) remember(cmd wire.Command, reply wire.Reply, stored bool) {
	if rn.recent == nil || !stored || len(reply.Result)+len(reply.Error) > maxRemembered {
		return
	}
	// A copy: the reply's result goes back to the caller, who may keep it.
	rn.recent.answered.Add(attemptKey{cmd.Key, cmd.Attempt}, answer{outcome: reply.Outcome, result: bytes.Clone(reply.Result), errText: reply.Error})
}
