// Package testhook is the test kit's seam into an engine (package
// sagatest): faults to inject and what the kit reads back, which the
// engine's public API must not offer. Hooks travel in the context given to
// Engine.Start, the way net/http/httptrace carries a ClientTrace: a run
// started without them is an ordinary run.
package testhook

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/attempt"
)

// Hooks are what a test adds to one run of an engine.
type Hooks struct {
	// Faults are injected into the run's step attempts.
	Faults *attempt.Faults
	// InHand is set by Engine.Start: how many step commands the run
	// holds (delivered and not yet answered, run at once, or copies the
	// kit delivers).
	InHand func() int
	// LoseChildEnds makes the run drop the ends of the children it
	// moves instead of telling their parents, as a process that stops
	// right after a child's last commit: only the reaper's sweep tells
	// them.
	LoseChildEnds bool
}

type hooksKey struct{}

// With returns ctx carrying h.
func With(ctx context.Context, h *Hooks) context.Context {
	return context.WithValue(ctx, hooksKey{}, h)
}

// From returns the hooks ctx carries, nil if none.
func From(ctx context.Context) *Hooks {
	h, _ := ctx.Value(hooksKey{}).(*Hooks)
	return h
}
