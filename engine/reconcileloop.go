package engine

import (
	"context"
	"time"
)

// reconcileLoop runs Reconcile every ReconcileInterval, the first one
// interval after the start (not while the engine starts up),
// setting the state_differences gauge from each run, until ctx ends. An
// engine that exports no metrics, or has NoReconcile, runs none.
func (e *Engine) reconcileLoop(ctx context.Context) {
	if e.cfg.Registerer == nil || e.cfg.ReconcileInterval <= 0 {
		return
	}
	t := time.NewTicker(e.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		e.reconcileOnce(ctx)
	}
}

// reconcileTimeout bounds one run of the engine's reconcile, whatever its
// interval: ticks that come during a run are dropped.
const reconcileTimeout = time.Minute

// reconcileOnce runs Reconcile once and sets the gauge by check, every
// check included (0 when it found nothing). A run that fails leaves the
// gauge as the last run set it, and counts as an error.
func (e *Engine) reconcileOnce(ctx context.Context) {
	m := e.c.Metrics()
	rctx, cancel := context.WithTimeout(ctx, reconcileTimeout)
	defer cancel()
	diffs, err := ReconcileSchema(rctx, e.cfg.Pool, e.cfg.Schema, e.c.Versions(), 0)
	if err != nil {
		if ctx.Err() == nil {
			m.ReconcileRuns.WithLabelValues("error").Inc()
			e.cfg.Logger.Warn("reconcile: the run failed; the state_differences metric keeps the last run's figures", "error", err)
		}
		return
	}
	found := map[string]int{}
	for _, d := range diffs {
		found[d.Check]++
	}
	for _, check := range Checks {
		m.StateDifferences.WithLabelValues(check).Set(float64(found[check]))
	}
	m.ReconcileRuns.WithLabelValues("ok").Inc()
}
