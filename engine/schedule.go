package engine

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/schedule"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Schedules start sagas at the ticks of a cron expression
// (saga.WithSchedule). Each engine that runs a definition with a schedule
// looks for its due ticks every Config.ScheduleInterval, on the database's
// clock, and starts each under saga.TickKey, in the transaction that
// records the tick in idemsaga.schedules: a tick starts once across every
// engine. Pause a schedule to stop its ticks without stopping its sagas.

// ScheduleIntervalDefault is Config.ScheduleInterval's default.
const ScheduleIntervalDefault = schedule.IntervalDefault

// ErrScheduleNotFound is returned by PauseSchedule and ResumeSchedule for
// a definition with no recorded schedule. Nothing is changed.
var ErrScheduleNotFound = errors.New("idemsaga: no schedule is recorded for this definition (a schedule is recorded when an engine that runs it starts; `schedules` lists them)")

// ScheduleInfo is a recorded schedule, as Schedules lists it.
type ScheduleInfo struct {
	// Definition is the definition's name.
	Definition string `json:"definition"`
	// Cron is the schedule's expression (saga.Schedule.Cron).
	Cron string `json:"cron"`
	// LastTick is the latest tick handled, started or skipped; the ticks
	// after it are due once their time comes.
	LastTick time.Time `json:"last_tick"`
	// LastStarted is the tick of the latest saga the schedule started,
	// nil before the first.
	LastStarted *time.Time `json:"last_started,omitempty"`
	// Next is the next tick to start (it may be due already), nil when
	// the expression cannot be read (a newer build's).
	Next *time.Time `json:"next,omitempty"`
	// Paused is set while the schedule is paused.
	Paused *SchedulePause `json:"paused,omitempty"`
}

// SchedulePause is who paused a schedule, when and why.
type SchedulePause struct {
	Since  time.Time `json:"since"`
	By     string    `json:"by"`
	Reason string    `json:"reason"`
}

// ScheduleRepair is what PauseSchedule or ResumeSchedule did.
type ScheduleRepair struct {
	// Definition is the definition's name.
	Definition string `json:"definition"`
	// Operation is "pause" or "resume".
	Operation string `json:"operation"`
	// Key is the request's key (Repair.Key, or the one made up for it).
	Key string `json:"key"`
	// At is when the repair's transaction began, on the database clock.
	At time.Time `json:"at"`
	// Replayed is true when the key named a repair already done: nothing
	// was written, and the rest is that repair's.
	Replayed bool `json:"replayed"`
}

// Schedules lists the recorded schedules, by definition.
func (cl *Client) Schedules(ctx context.Context) ([]ScheduleInfo, error) {
	rows, err := store.ListSchedules(ctx, cl.c.DB())
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read the schedules: %w", err)
	}
	out := make([]ScheduleInfo, len(rows))
	for i, r := range rows {
		out[i] = ScheduleInfo{Definition: r.Definition, Cron: r.Cron, LastTick: r.LastTick, LastStarted: r.LastStarted}
		if c, err := saga.ParseCron(r.Cron); err == nil {
			next := c.Next(r.LastTick).UTC()
			out[i].Next = &next
		}
		if r.PausedAt != nil {
			out[i].Paused = &SchedulePause{Since: *r.PausedAt, By: r.PausedBy, Reason: r.Reason}
		}
	}
	return out, nil
}

// PauseSchedule stops the ticks of definition's schedule, in every
// engine, until ResumeSchedule: the ticks that come due meanwhile are
// skipped, never started. The sagas it started run on (pause them with
// PauseDefinition). A schedule paused already is ErrStateForbids, one
// never recorded ErrScheduleNotFound. The pause is recorded, with who
// and why, in idemsaga.schedule_repairs; Repair.Key makes it safe to send
// again.
func (cl *Client) PauseSchedule(ctx context.Context, definition string, r Repair) (ScheduleRepair, error) {
	return cl.scheduleRepair(ctx, nil, definition, "pause", r)
}

// PauseScheduleTx is PauseSchedule in the caller's transaction tx, as a
// savepoint in it: it takes effect when tx commits, and not at all if tx
// rolls back.
func (cl *Client) PauseScheduleTx(ctx context.Context, tx pgx.Tx, definition string, r Repair) (ScheduleRepair, error) {
	return cl.scheduleRepair(ctx, tx, definition, "pause", r)
}

// ResumeSchedule lets a paused schedule tick again from now on: its next
// tick is the first after the resume (the ticks of the pause stay
// skipped). A schedule not paused is ErrStateForbids.
func (cl *Client) ResumeSchedule(ctx context.Context, definition string, r Repair) (ScheduleRepair, error) {
	return cl.scheduleRepair(ctx, nil, definition, "resume", r)
}

// ResumeScheduleTx is ResumeSchedule in the caller's transaction tx, as a
// savepoint in it: it takes effect when tx commits, and not at all if tx
// rolls back.
func (cl *Client) ResumeScheduleTx(ctx context.Context, tx pgx.Tx, definition string, r Repair) (ScheduleRepair, error) {
	return cl.scheduleRepair(ctx, tx, definition, "resume", r)
}

// scheduleRepair pauses or resumes a schedule, as op says, in a savepoint
// of in (nil: a transaction of its own).
func (cl *Client) scheduleRepair(ctx context.Context, in pgx.Tx, definition, op string, r Repair) (ScheduleRepair, error) {
	if r.Key == "" {
		r.Key = uuid.NewString()
	}
	if err := saga.CheckKey(r.Key); err != nil {
		return ScheduleRepair{}, err
	}
	res := ScheduleRepair{Definition: definition, Operation: op, Key: r.Key}
	var tx pgx.Tx
	var err error
	if in != nil {
		tx, err = in.Begin(ctx)
	} else {
		tx, err = cl.c.Pool().Begin(ctx)
	}
	if err != nil {
		return res, fmt.Errorf("idemsaga: %s schedule of %q: %w", op, definition, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	sum := sha256.Sum256([]byte(op + "\x00" + r.Reason))
	inserted, recorded, at, err := store.RecordScheduleRepair(ctx, cl.c.Schema().Q(tx), definition, r.Key, op, sum[:], r.Reason, r.By)
	res.At = at
	switch {
	case errors.Is(err, store.ErrScheduleNotRecorded):
		return res, fmt.Errorf("%w: %q", ErrScheduleNotFound, definition)
	case err != nil:
		return res, fmt.Errorf("idemsaga: %s schedule of %q: record the request: %w", op, definition, err)
	case !inserted && string(recorded) != string(sum[:]):
		return res, fmt.Errorf("%w (schedule of %q, key %q)", ErrRepairKeyReused, definition, r.Key)
	case !inserted:
		res.Replayed = true
		return res, nil
	}
	var done bool
	if op == "pause" {
		done, err = store.PauseSchedule(ctx, cl.c.Schema().Q(tx), definition, r.By, r.Reason)
	} else {
		done, err = store.ResumeSchedule(ctx, cl.c.Schema().Q(tx), definition)
	}
	switch {
	case err != nil:
		return res, fmt.Errorf("idemsaga: %s schedule of %q: %w", op, definition, err)
	case !done && op == "pause":
		return res, fmt.Errorf("%w: the schedule of %q is paused already; resume it with `schedules resume %s`", ErrStateForbids, definition, definition)
	case !done:
		return res, fmt.Errorf("%w: the schedule of %q is not paused", ErrStateForbids, definition)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("idemsaga: %s schedule of %q: %w", op, definition, err)
	}
	return res, nil
}

// tickStarter starts a schedule's ticks through the client.
type tickStarter struct{ cl *Client }

func (s tickStarter) StartTx(ctx context.Context, tx pgx.Tx, def *saga.Definition, key string, input any) (bool, error) {
	res, err := s.cl.StartTx(ctx, tx, def, key, input)
	return res.Duplicate, err
}
