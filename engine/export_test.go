package engine

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/wire"
)

// HandleCommand and ApplyReply let the external tests drive one command
// or reply by hand; they take the engine's internal wire types, so they
// are not part of the public API.
func (e *Engine) HandleCommand(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return e.handleCommand(ctx, cmd)
}

func (e *Engine) ApplyReply(ctx context.Context, r wire.Reply) (Verdict, error) {
	return e.applyReply(ctx, r)
}
