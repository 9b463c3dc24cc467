package saga

import (
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// Schedule starts a saga of a definition at each tick of a cron
// expression (WithSchedule).
//
// The rules:
//   - Each tick starts one saga across every engine sharing the database,
//     under the key TickKey(tick): a tick is never started twice, whatever
//     the number of workers, their crashes or restarts.
//   - Ticks are measured on the database's clock (idemsaga.now()), so
//     the test kit's Clock.Advance makes them come due.
//   - The latest due tick always starts, late or not. Earlier due ticks
//     no engine started (every worker was down, or the schedule was
//     behind) are missed: the latest CatchUp of them start too, oldest
//     first; older ones are skipped for good (counted, never started).
//   - A paused schedule starts nothing; the ticks that come due while it
//     is paused are skipped, and resuming starts from the next tick.
//   - A schedule is recorded when an engine that runs it first starts:
//     ticks before that are not due.
type Schedule struct {
	// Cron says when: five fields (minute, hour, day of month, month,
	// day of week) or a descriptor (@hourly, @daily, @weekly, @monthly,
	// @yearly, or @every with a duration of at least a minute), read by
	// github.com/robfig/cron/v3's standard parser. Times are UTC unless
	// the expression starts with CRON_TZ=<zone>, as in
	// "CRON_TZ=Europe/Paris 0 2 * * *". Required.
	Cron string
	// InputFunc returns the input of the saga a tick starts, which goes
	// through the definition's input rules (WithInput) as Start's does.
	// It must give the same input for the same tick: the tick's key
	// names one intent, and another input under it is refused
	// (ErrIdempotencyKeyReused) and the tick skipped. An error leaves the
	// tick due, to be tried again at the next pass. Defaults to the
	// object {"tick": "<the tick, RFC 3339 in UTC>"}.
	InputFunc func(tick time.Time) (any, error)
	// CatchUp is how many missed ticks before the latest due one are
	// started too (see the rules above), 0 to ScheduleCatchUpMax.
	// Defaults to 0: only the latest due tick starts.
	CatchUp int
}

// ScheduleCatchUpMax bounds Schedule.CatchUp: a schedule that fell
// further behind starts its latest ticks only, rather than a flood.
const ScheduleCatchUpMax = 1000

// ScheduleEveryMin is the shortest interval of an "@every" schedule.
const ScheduleEveryMin = time.Minute

// TickKeyPrefix begins the key of every saga a schedule started.
const TickKeyPrefix = "tick:"

// TickKey returns the key of the saga a schedule starts at tick:
// "tick:" and the tick in RFC 3339, in UTC.
func TickKey(tick time.Time) string { return TickKeyPrefix + tick.UTC().Format(time.RFC3339) }

// TickInput is a schedule's input when Schedule.InputFunc is nil.
type TickInput struct {
	Tick time.Time `json:"tick"`
}

// WithSchedule returns a copy of d that starts a saga at each tick of s
// in every engine that runs it (see Schedule for the rules). A
// definition has at most one schedule; a later WithSchedule replaces it.
// The schedule, without its InputFunc, is part of the definition's
// Description. It panics with a *DefinitionError, as WithVersion does, on
// a schedule that is not valid: check a schedule that comes from
// configuration with Schedule.Validate first.
//
//	var settlement = saga.WithSchedule(saga.MustNew("settlement", steps...),
//		saga.Schedule{Cron: "0 2 * * *"}) // every night at 02:00 UTC
func WithSchedule(d *Definition, s Schedule) *Definition {
	if field, problem := s.check(); problem != "" {
		panic(&DefinitionError{Definition: d.name, Field: field, Problem: problem})
	}
	c := *d
	c.schedule = &s
	return &c
}

// Validate checks s as WithSchedule does. The error wraps
// ErrInvalidDefinition and names the field.
func (s Schedule) Validate() error {
	if field, problem := s.check(); problem != "" {
		return fmt.Errorf("%w: %s: %s", ErrInvalidDefinition, field, problem)
	}
	return nil
}

// check returns the field that is not valid and why, or "" and "".
func (s Schedule) check() (field, problem string) {
	if _, err := ParseCron(s.Cron); err != nil {
		return "Schedule.Cron", err.Error()
	}
	if s.CatchUp < 0 || s.CatchUp > ScheduleCatchUpMax {
		return "Schedule.CatchUp", fmt.Sprintf("is %d; give 0 (only the latest due tick) to %d", s.CatchUp, ScheduleCatchUpMax)
	}
	return "", ""
}

// ParseCron reads a Schedule.Cron expression.
func ParseCron(spec string) (cron.Schedule, error) {
	if strings.TrimSpace(spec) == "" {
		return nil, fmt.Errorf("is empty; give five fields (\"0 2 * * *\": at 02:00 every day) or a descriptor (@hourly)")
	}
	// The parser's own default zone is the process's: UTC instead, so
	// that every engine reads the expression alike.
	zoned := spec
	if !strings.HasPrefix(spec, "CRON_TZ=") && !strings.HasPrefix(spec, "TZ=") {
		zoned = "CRON_TZ=UTC " + spec
	}
	s, err := cron.ParseStandard(zoned)
	if err != nil {
		return nil, fmt.Errorf("%q is not a cron expression: %v; give five fields (minute hour day-of-month month day-of-week) or a descriptor (@daily)", spec, err)
	}
	if every, ok := s.(cron.ConstantDelaySchedule); ok && every.Delay < ScheduleEveryMin {
		return nil, fmt.Errorf("%q ticks every %s; a schedule ticks at most once a minute", spec, every.Delay)
	}
	return s, nil
}

// Schedule returns the definition's schedule (WithSchedule), and whether
// it has one.
func (d *Definition) Schedule() (Schedule, bool) {
	if d.schedule == nil {
		return Schedule{}, false
	}
	return *d.schedule, true
}

// ScheduleDescription is a Schedule in a Description: what every process
// must agree on (its InputFunc lives in the code).
type ScheduleDescription struct {
	Cron    string `json:"cron"`
	CatchUp int    `json:"catch_up,omitempty"`
	// Input says where a tick's input comes from: "tick" for the
	// default ({"tick": …}), "func" for an InputFunc.
	Input string `json:"input"`
}

// describeSchedule returns the schedule's description, nil for none.
func (d *Definition) describeSchedule() *ScheduleDescription {
	if d.schedule == nil {
		return nil
	}
	in := "tick"
	if d.schedule.InputFunc != nil {
		in = "func"
	}
	return &ScheduleDescription{Cron: d.schedule.Cron, CatchUp: d.schedule.CatchUp, Input: in}
}

// schedule rebuilds the described schedule, without its InputFunc: a
// definition from a description never starts ticks.
func (sd *ScheduleDescription) schedule(definition string) (*Schedule, error) {
	if sd == nil {
		return nil, nil
	}
	s := Schedule{Cron: sd.Cron, CatchUp: sd.CatchUp}
	if field, problem := s.check(); problem != "" {
		return nil, fmt.Errorf("%w: description of %q: %s: %s", ErrInvalidDefinition, definition, field, problem)
	}
	return &s, nil
}
