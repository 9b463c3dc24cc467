package engine

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/broker"
)

// watchFailovers redelivers, at each leader election of the stream or of
// this engine's consumers, what the work queue still holds
// (broker.RedeliverOnFailover), so that a node lost in a JetStream
// cluster costs seconds rather than AckWait or a lease. One engine of the
// deployment acts on each election. Without the permission to read the
// advisories the engine says so and leaves failovers to AckWait and
// leases.
func (e *Engine) watchFailovers(ctx context.Context) {
	err := broker.RedeliverOnFailover(ctx, e.cfg.NATS, e.js, broker.FailoverConfig{
		Stream:           e.cfg.Stream,
		ConsumerPrefixes: []string{e.cfg.Stream + commandsConsumer + "_", e.cfg.Stream + repliesConsumer + "_"},
		Logger:           e.cfg.Logger,
	})
	if err != nil {
		e.cfg.Logger.Warn("JetStream failovers will be slow: a new leader redelivers what the old one held only after AckWait", "error", err)
		return
	}
	<-ctx.Done()
}
