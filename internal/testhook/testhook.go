// Package testhook is the test kit's door into an engine (package
// sagatest): what it needs of one that the engine's public API must not
// offer. Package engine fills the variables in its init.
package testhook

import "github.com/idemsaga/idemsaga/internal/attempt"

var (
	// NewEngine builds an engine (*engine.Engine) from its Config, with
	// faults armed by the test kit.
	NewEngine func(cfg any, faults *attempt.Faults) (any, error)
	// InHand returns the step commands an engine holds: delivered and
	// not yet answered, run at once, or copies the kit delivers.
	InHand func(engine any) int
)
