// Package lifecycle is the one Start/Stop shape shared by every background
// service of the engine: the relay, the orchestrator, the step workers and
// the reaper.
package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// ErrAlreadyStarted is returned by Start on a running service.
var ErrAlreadyStarted = errors.New("idemsaga: service already started; call Stop first")

// Runner runs a service's goroutines under one cancellable context.
// The zero value is ready to use.
type Runner struct {
	mu      sync.Mutex
	cancel  context.CancelFunc
	wg      *sync.WaitGroup
	running bool
}

// Start launches each loop in its own goroutine under a context derived
// from ctx without its cancellation (the service runs until Stop), and
// returns at once.
func (r *Runner) Start(ctx context.Context, loops ...func(ctx context.Context)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return ErrAlreadyStarted
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	wg := &sync.WaitGroup{}
	for _, loop := range loops {
		wg.Go(func() { loop(runCtx) })
	}
	r.cancel, r.wg, r.running = cancel, wg, true
	return nil
}

// Stop cancels the loops' context and waits for them to return, or for ctx
// to end, whichever comes first. Loops are expected to finish the work in
// hand before they return. Stop on a stopped Runner returns nil.
func (r *Runner) Stop(ctx context.Context) error {
	r.mu.Lock()
	if !r.running {
		r.mu.Unlock()
		return nil
	}
	cancel, wg := r.cancel, r.wg
	r.running = false
	r.mu.Unlock()

	cancel()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("idemsaga: stop did not finish in time, work still in flight is left to lease expiry: %w", ctx.Err())
	}
}

// Running reports whether the service is started.
func (r *Runner) Running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.running
}
