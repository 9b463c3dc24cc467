package orchestrate

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/outbox"
)

// HandOff is where the outbox rows a transaction of the core committed go
// (the orchestrator's, the reaper's, a repair's): a command this
// process's step workers can take runs here at once, the rest is published
// by this process right after the commit, and the relay's sweep takes over
// whatever that missed after the hand-off. A client that runs no worker
// has none: its rows are the relay's at once, wherever one runs.
type HandOff interface {
	// Committed takes rows a transaction committed.
	Committed(rows []outbox.Committed)
	// PublishAfter is the publish_after of the rows the core writes: the
	// hand-off in milliseconds while this process publishes its own rows,
	// nil (the relay's at once) while it does not.
	PublishAfter() any
	// Backlog reads the stream's backlog, for the reaper to tell a
	// command still queued from one lost; ok is false when unknown.
	Backlog(ctx context.Context) (b maintenance.Backlog, ok bool)
}
