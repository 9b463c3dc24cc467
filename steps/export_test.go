package steps

import (
	"context"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/wire"
)

// Handle and HandleRedelivered let the tests run one command by hand.
func (w *Worker) Handle(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.handle(ctx, cmd, false)
}

func (w *Worker) HandleRedelivered(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.handle(ctx, cmd, true)
}

// Metrics returns the worker's counters.
func (w *Worker) Metrics() *metrics.Metrics { return w.metrics }
