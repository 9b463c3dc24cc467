package store

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements of schedules (saga.WithSchedule): their rows, a
// scheduler's pass, and their pauses.

// registerSchedule records a schedule the first time an engine that runs
// it starts, due from now on; a later start only records its cron.
const registerSchedule = `insert into idemsaga.schedules (definition, cron, last_tick) values ($1, $2, idemsaga.now())
on conflict (definition) do update set cron = excluded.cron, updated_at = idemsaga.now()
where schedules.cron <> excluded.cron`

// selectSchedules reads the schedules of the definitions named ($1),
// with the database's time, without locks: a scheduler locks only those
// it finds due.
const selectSchedules = `select definition, last_tick, paused_at is not null, idemsaga.now() from idemsaga.schedules where definition = any($1)`

// lockSchedule locks one schedule for a pass, skipping it when another
// engine's pass holds it, and reads it again with the database's time.
const lockSchedule = `select last_tick, paused_at is not null, idemsaga.now() from idemsaga.schedules where definition = $1 for update skip locked`

// advanceSchedule records a pass: the latest tick handled ($2) and the
// latest tick started ($3, NULL when it started none). It never moves
// last_tick back.
const advanceSchedule = `update idemsaga.schedules set last_tick = greatest(last_tick, $2), last_started = coalesce($3, last_started), updated_at = idemsaga.now()
where definition = $1`

// listSchedules reads every schedule, by definition.
const listSchedules = `select definition, cron, last_tick, last_started, paused_at, paused_by, pause_reason from idemsaga.schedules order by definition`

// insertScheduleRepair records a pause or resume of a schedule under its
// request key first: a concurrent request under the same key waits on
// it, then finds it. It returns whether it inserted, and when; no row when
// the schedule is not recorded.
const insertScheduleRepair = `with s as (select definition from idemsaga.schedules where definition = $1), i as (
  insert into idemsaga.schedule_repairs (definition, request_key, operation, request_hash, reason, requested_by)
  select definition, $2, $3, $4, $5, $6 from s
  on conflict (definition, request_key) do nothing
  returning created_at
)
select exists (select 1 from i), coalesce((select created_at from i), idemsaga.now()) from s`

// selectScheduleRepair reads a recorded request's hash and time.
const selectScheduleRepair = `select request_hash, created_at from idemsaga.schedule_repairs where definition = $1 and request_key = $2`

// pauseSchedule pauses a schedule; one paused already is left as it is
// (no row).
const pauseSchedule = `update idemsaga.schedules set paused_at = idemsaga.now(), paused_by = $2, pause_reason = $3, updated_at = idemsaga.now()
where definition = $1 and paused_at is null returning paused_at`

// resumeSchedule resumes a paused schedule (no row when it was not): the
// ticks that came due while it was paused are skipped, so its next tick
// is the first after now.
const resumeSchedule = `update idemsaga.schedules set paused_at = null, paused_by = null, pause_reason = null,
  last_tick = greatest(last_tick, idemsaga.now()), updated_at = idemsaga.now()
where definition = $1 and paused_at is not null returning idemsaga.now()`

// Queryer runs a query of many rows: a pool, a connection or a
// transaction.
type Queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ScheduleState is a schedule's row.
type ScheduleState struct {
	Definition string
	Cron       string
	// LastTick is the latest tick handled: started, or skipped.
	LastTick    time.Time
	LastStarted *time.Time
	PausedAt    *time.Time
	PausedBy    string
	Reason      string
}

// Due is what a scheduler reads of a schedule before a pass.
type Due struct {
	Definition string
	LastTick   time.Time
	Paused     bool
	// Now is the database's time (idemsaga.now()).
	Now time.Time
}

// RegisterSchedule records definition's schedule (its cron) when no
// engine recorded it yet, due from now on, and records its cron otherwise.
func RegisterSchedule(ctx context.Context, q Querier, definition, cron string) error {
	_, err := q.Exec(ctx, registerSchedule, definition, cron)
	return Interpret(err)
}

// Schedules reads the schedules of the definitions named, with the
// database's time.
func Schedules(ctx context.Context, q Queryer, definitions []string) ([]Due, error) {
	rows, err := q.Query(ctx, selectSchedules, definitions)
	if err != nil {
		return nil, Interpret(err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Due, error) {
		var d Due
		err := row.Scan(&d.Definition, &d.LastTick, &d.Paused, &d.Now)
		return d, err
	})
}

// LockSchedule locks definition's schedule in tx for a pass; locked is
// false when another pass holds it (or it is not recorded).
func LockSchedule(ctx context.Context, tx Querier, definition string) (d Due, locked bool, err error) {
	d.Definition = definition
	err = tx.QueryRow(ctx, lockSchedule, definition).Scan(&d.LastTick, &d.Paused, &d.Now)
	if errors.Is(err, pgx.ErrNoRows) {
		return d, false, nil
	}
	return d, err == nil, Interpret(err)
}

// AdvanceSchedule records a pass of definition's schedule: handled is the
// latest tick handled, started the latest tick started (nil for none).
func AdvanceSchedule(ctx context.Context, q Querier, definition string, handled time.Time, started *time.Time) error {
	_, err := q.Exec(ctx, advanceSchedule, definition, handled, started)
	return Interpret(err)
}

// ListSchedules reads every recorded schedule, by definition.
func ListSchedules(ctx context.Context, q Queryer) ([]ScheduleState, error) {
	rows, err := q.Query(ctx, listSchedules)
	if err != nil {
		return nil, Interpret(err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (ScheduleState, error) {
		var s ScheduleState
		var by, why *string
		err := row.Scan(&s.Definition, &s.Cron, &s.LastTick, &s.LastStarted, &s.PausedAt, &by, &why)
		if by != nil {
			s.PausedBy = *by
		}
		if why != nil {
			s.Reason = *why
		}
		return s, err
	})
}

// ErrScheduleNotRecorded is returned by RecordScheduleRepair for a
// definition whose schedule no engine recorded.
var ErrScheduleNotRecorded = errors.New("idemsaga: no schedule is recorded for the definition")

// RecordScheduleRepair records a pause or resume (op) of definition's
// schedule under its request key, with the hash of what it asks. inserted
// is false when the key was recorded already: hash is then the recorded
// request's, at its time.
func RecordScheduleRepair(ctx context.Context, tx Querier, definition, key, op string, hash []byte, reason, by string) (inserted bool, recorded []byte, at time.Time, err error) {
	err = tx.QueryRow(ctx, insertScheduleRepair, definition, key, op, hash, reason, by).Scan(&inserted, &at)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil, at, ErrScheduleNotRecorded
	}
	if err != nil || inserted {
		return inserted, hash, at, Interpret(err)
	}
	err = tx.QueryRow(ctx, selectScheduleRepair, definition, key).Scan(&recorded, &at)
	return false, recorded, at, Interpret(err)
}

// PauseSchedule pauses definition's schedule; paused is false when it was
// paused already.
func PauseSchedule(ctx context.Context, tx Querier, definition, by, reason string) (paused bool, err error) {
	var at time.Time
	err = tx.QueryRow(ctx, pauseSchedule, definition, by, reason).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, Interpret(err)
}

// ResumeSchedule resumes definition's schedule from now on; resumed is
// false when it was not paused.
func ResumeSchedule(ctx context.Context, tx Querier, definition string) (resumed bool, err error) {
	var at time.Time
	err = tx.QueryRow(ctx, resumeSchedule, definition).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, Interpret(err)
}
