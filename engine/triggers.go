package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemsaga/idemsaga/internal/events"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/schedule"
)

// triggers are what starts sagas inside an engine: the scheduler of the
// definitions with a schedule and the consumers of those with events.
type triggers struct {
	scheduler *schedule.Scheduler
	events    *events.Consumers
}

// newTriggers builds the engine's scheduler and event consumers.
func (e *Engine) newTriggers(m *metrics.Metrics) error {
	if e.cfg.ScheduleInterval < 0 || e.cfg.EventConcurrency < 0 {
		return errors.New("idemsaga: Config.ScheduleInterval and EventConcurrency must not be negative; leave them 0 for the defaults")
	}
	var err error
	e.trig.scheduler, err = schedule.New(schedule.Config{
		Pool: e.cfg.Pool, Schema: e.c.Schema(), Definitions: e.cfg.Definitions, Starter: tickStarter{e.client}, Interval: e.cfg.ScheduleInterval,
		Metrics: m, Logger: e.cfg.Logger,
	})
	if err != nil {
		return err
	}
	e.trig.events, err = events.New(events.Config{
		Pool: e.cfg.Pool, Schema: e.c.Schema(), JetStream: e.js, Definitions: e.cfg.Definitions, ConsumerPrefix: e.cfg.Stream, OwnSubjects: e.cfg.SubjectPrefix,
		AckWait: e.cfg.AckWait, Concurrency: e.cfg.EventConcurrency, Starter: eventStarter{e.client}, Metrics: m, Logger: e.cfg.Logger,
	})
	return err
}

// startTriggers checks that every definition's events have a stream,
// records the schedules not recorded yet, and starts both.
func (e *Engine) startTriggers(ctx, work context.Context) error {
	if err := e.trig.events.Check(ctx); err != nil {
		return err
	}
	if err := e.trig.scheduler.Start(work); err != nil {
		return fmt.Errorf("idemsaga: start the scheduler: %w", err)
	}
	return e.trig.events.Start(work, work)
}

// stopTriggers stops what starts sagas, first of all: no new saga begins
// while the engine drains.
func (e *Engine) stopTriggers(ctx context.Context) []error {
	return []error{e.trig.events.Stop(ctx), e.trig.scheduler.Stop(ctx)}
}
