// Package schedule starts the sagas of definitions with a schedule
// (saga.WithSchedule): each engine runs a Scheduler, and every tick is
// started once across them, under its key (saga.TickKey), in the same
// transaction that records it in idemsaga.schedules.
package schedule

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/robfig/cron/v3"

	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// IntervalDefault is Config.Interval's default: how often a scheduler
// looks for due ticks.
const IntervalDefault = time.Second

// passTimeout bounds one pass over one schedule.
const passTimeout = 30 * time.Second

// Starter starts a saga in the caller's transaction, as
// engine.Client.StartTx does; duplicate says the key named a saga with
// the same input already.
type Starter interface {
	StartTx(ctx context.Context, tx pgx.Tx, def *saga.Definition, key string, input any) (duplicate bool, err error)
}

// Config configures a Scheduler.
type Config struct {
	// Pool holds the engine's tables. Required.
	Pool *pgxpool.Pool
	// Schema is the deployment's schema; nil for the default.
	Schema *pgschema.Schema
	// Definitions are the process's. For each name the highest version
	// decides: its schedule, if it has one, starts sagas of that version.
	Definitions []*saga.Definition
	// Starter starts the ticks' sagas. Required.
	Starter Starter
	// Interval is how often due ticks are looked for. Defaults to
	// IntervalDefault.
	Interval time.Duration
	// Metrics counts the ticks. Required.
	Metrics *metrics.Metrics
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Scheduler starts the due ticks of the schedules of its definitions.
type Scheduler struct {
	cfg    Config
	defs   map[string]*saga.Definition
	crons  map[string]cron.Schedule
	names  []string
	runner lifecycle.Runner
}

// New returns a scheduler of cfg's definitions that have a schedule.
func New(cfg Config) (*Scheduler, error) {
	if cfg.Pool == nil || cfg.Starter == nil || cfg.Metrics == nil {
		return nil, errors.New("idemsaga: schedule: Config.Pool, Starter and Metrics are required")
	}
	if cfg.Interval < 0 {
		return nil, fmt.Errorf("idemsaga: schedule: Config.Interval is %s; give a positive duration, or 0 for %s", cfg.Interval, IntervalDefault)
	}
	if cfg.Interval == 0 {
		cfg.Interval = IntervalDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	latest := map[string]*saga.Definition{}
	for _, d := range cfg.Definitions {
		if have, ok := latest[d.Name()]; !ok || d.Version() > have.Version() {
			latest[d.Name()] = d
		}
	}
	s := &Scheduler{cfg: cfg, defs: map[string]*saga.Definition{}, crons: map[string]cron.Schedule{}}
	for name, d := range latest {
		sc, ok := d.Schedule()
		if !ok {
			continue
		}
		c, err := saga.ParseCron(sc.Cron)
		if err != nil {
			return nil, fmt.Errorf("idemsaga: schedule of %s: %w", d.Ref(), err)
		}
		s.defs[name], s.crons[name] = d, c
		s.names = append(s.names, name)
	}
	slices.Sort(s.names)
	return s, nil
}

// Len returns how many schedules the scheduler runs.
func (s *Scheduler) Len() int { return len(s.names) }

// Start records the schedules not recorded yet (due from now on) and
// runs a pass every Interval until Stop. It returns at once.
func (s *Scheduler) Start(ctx context.Context) error {
	for _, name := range s.names {
		sc, _ := s.defs[name].Schedule()
		if err := store.RegisterSchedule(ctx, s.cfg.Schema.Q(s.cfg.Pool), name, sc.Cron); err != nil {
			return fmt.Errorf("idemsaga: record the schedule of %s: %w", name, err)
		}
	}
	if len(s.names) == 0 {
		return nil
	}
	return s.runner.Start(ctx, s.loop)
}

// Stop ends the passes, letting the one in hand finish.
func (s *Scheduler) Stop(ctx context.Context) error { return s.runner.Stop(ctx) }

func (s *Scheduler) loop(ctx context.Context) {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := s.PassOnce(context.WithoutCancel(ctx)); err != nil {
			s.cfg.Logger.Warn("scheduler: pass failed; will try again", "error", err)
		}
	}
}

// PassOnce starts the due ticks of every schedule not paused, and
// returns how many sagas it started.
func (s *Scheduler) PassOnce(ctx context.Context) (int, error) {
	dues, err := store.Schedules(ctx, s.cfg.Schema.Q(s.cfg.Pool), s.names)
	if err != nil {
		return 0, fmt.Errorf("idemsaga: read the schedules: %w", err)
	}
	var started int
	var errs []error
	for _, d := range dues {
		c, ok := s.crons[d.Definition]
		if !ok || d.Paused || c.Next(d.LastTick).After(d.Now) {
			continue
		}
		n, err := s.pass(ctx, s.defs[d.Definition], c)
		started += n
		if err != nil {
			errs = append(errs, err)
		}
	}
	return started, errors.Join(errs...)
}

// pass starts the due ticks of def's schedule, under the schedule's row
// lock: a schedule another engine's pass holds is left to it.
func (s *Scheduler) pass(ctx context.Context, def *saga.Definition, c cron.Schedule) (started int, err error) {
	ctx, cancel := context.WithTimeout(ctx, passTimeout)
	defer cancel()
	name := def.Name()
	tx, err := s.cfg.Pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("idemsaga: schedule of %s: %w", name, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	due, locked, err := store.LockSchedule(ctx, s.cfg.Schema.Q(tx), name)
	if err != nil {
		return 0, fmt.Errorf("idemsaga: schedule of %s: %w", name, err)
	}
	if !locked || due.Paused {
		return 0, nil
	}
	sc, _ := def.Schedule()
	w := Due(c, due.LastTick, due.Now, sc.CatchUp)
	if len(w.Start) == 0 {
		return 0, nil
	}
	m := s.cfg.Metrics.ScheduleTicks
	handled := w.LastSkipped
	if handled.IsZero() {
		handled = due.LastTick
	}
	var last *time.Time
	// Counted once the pass committed.
	counts := map[string]int{}
	for _, tick := range w.Start {
		key := saga.TickKey(tick)
		input, err := tickInput(sc, tick)
		if err != nil {
			// Left due: the next pass asks again.
			s.cfg.Logger.Warn("scheduler: the schedule's InputFunc failed; the tick stays due", "definition", name, "tick", key, "error", err)
			break
		}
		dup, err := s.cfg.Starter.StartTx(ctx, tx, def, key, input)
		switch {
		case errors.Is(err, saga.ErrInvalidInput), errors.Is(err, saga.ErrIdempotencyKeyReused):
			s.cfg.Logger.Error("scheduler: a tick's input was refused; the tick is skipped (fix the schedule's InputFunc or the definition's input type)",
				"definition", name, "tick", key, "error", err)
			counts[metrics.TickRefused]++
		case err != nil:
			return 0, fmt.Errorf("idemsaga: schedule of %s: start tick %s: %w", name, key, err)
		case dup:
			counts[metrics.TickDuplicate]++
		default:
			started++
			t := tick
			last = &t
			counts[metrics.TickStarted]++
		}
		handled = tick
	}
	if !handled.After(due.LastTick) {
		return 0, nil
	}
	if err := store.AdvanceSchedule(ctx, s.cfg.Schema.Q(tx), name, handled, last); err != nil {
		return 0, fmt.Errorf("idemsaga: schedule of %s: %w", name, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("idemsaga: schedule of %s: %w", name, err)
	}
	for outcome, n := range counts {
		m.WithLabelValues(name, outcome).Add(float64(n))
	}
	if w.Skipped > 0 {
		m.WithLabelValues(name, metrics.TickSkipped).Add(float64(w.Skipped))
		s.cfg.Logger.Warn("scheduler: missed ticks skipped, past the schedule's catch-up bound", "definition", name, "skipped", w.Skipped,
			"catch_up", sc.CatchUp, "latest_skipped", w.LastSkipped.UTC().Format(time.RFC3339))
	}
	return started, nil
}

// tickInput is the input of tick's saga.
func tickInput(sc saga.Schedule, tick time.Time) (any, error) {
	if sc.InputFunc == nil {
		return saga.TickInput{Tick: tick.UTC()}, nil
	}
	return sc.InputFunc(tick.UTC())
}

// Window is what a pass does with the ticks due: those it starts, oldest
// first, and those it skips.
type Window struct {
	// Start are the ticks to start: the latest due and up to catchUp
	// before it, oldest first.
	Start []time.Time
	// Skipped is how many due ticks before those are skipped, and
	// LastSkipped the latest of them (zero when none).
	Skipped     int
	LastSkipped time.Time
}

// Due returns the ticks of c after last and at or before now, split by
// the catch-up bound.
func Due(c cron.Schedule, last, now time.Time, catchUp int) Window {
	var w Window
	keep := catchUp + 1
	var ring []time.Time
	for t := c.Next(last); !t.IsZero() && !t.After(now); t = c.Next(t) {
		if len(ring) == keep {
			w.Skipped++
			w.LastSkipped = ring[0]
			ring = append(ring[:0], ring[1:]...)
		}
		ring = append(ring, t)
	}
	w.Start = ring
	return w
}
