package engine

import (
	"context"
	"time"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/outbox"
)

// engineHandOff is an engine's handOff: its step workers, its relay and
// its stream's backlog.
type engineHandOff struct {
	relay   *outbox.Relay
	after   time.Duration
	backlog *maintenance.StreamBacklog
	// steps are the engine's step workers; they move sagas through the
	// core, so they are built after it, before the engine starts.
	steps *attempt.Runner
}

// Committed runs what this process's step workers can take at once and
// publishes the rest.
func (h *engineHandOff) Committed(rows []outbox.Committed) {
	if len(rows) == 0 {
		return
	}
	if h.steps != nil {
		kept := rows[:0:0]
		for _, r := range rows {
			if !h.steps.Offer(r) {
				kept = append(kept, r)
			}
		}
		if rows = kept; len(rows) == 0 {
			return
		}
	}
	h.Publish(rows...)
}

// Publish publishes rows an attempt of the engine's step workers committed
// (attempt.Publisher): they run their next steps themselves.
func (h *engineHandOff) Publish(rows ...outbox.Committed) { h.relay.Publish(rows...) }

// PublishAfter is the hand-off while the relay runs, nil otherwise.
func (h *engineHandOff) PublishAfter() any {
	if !h.relay.Running() {
		return nil
	}
	return h.after.Milliseconds()
}

// Backlog reads the engine's stream's backlog.
func (h *engineHandOff) Backlog(ctx context.Context) (maintenance.Backlog, bool) {
	return h.backlog.Get(ctx)
}
