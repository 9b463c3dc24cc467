package sagatest

import (
	"context"
	"errors"
	"time"

	"github.com/idemsaga/idemsaga/saga"
)

// Tick moves the clock to the next tick of def's schedule
// (saga.WithSchedule), the first after the clock's now when the clock
// has already passed the ticks the engine recorded, and returns the saga
// that tick started, run to its end as Wait runs it. The kit's engine looks for due ticks every few
// milliseconds, so a test may also move the clock itself and find the
// tick's saga by its key, saga.TickKey(tick).
func (e *Env) Tick(t T, def *saga.Definition) *saga.Instance {
	t.Helper()
	ctx := context.Background()
	if _, ok := def.Schedule(); !ok {
		t.Fatalf("sagatest: Tick: definition %s has no schedule (saga.WithSchedule)", def.Name())
	}
	list, err := e.Client.Schedules(ctx)
	if err != nil {
		t.Fatalf("sagatest: Tick: %v", err)
	}
	var next *time.Time
	for _, s := range list {
		if s.Definition == def.Name() {
			next = s.Next
		}
	}
	if next == nil {
		t.Fatalf("sagatest: Tick: the engine recorded no schedule for %s; give the definition to sagatest.New", def.Name())
	}
	now, err := e.Clock.Now(ctx)
	if err != nil {
		t.Fatalf("sagatest: Tick: %v", err)
	}
	if !next.After(now) {
		// The clock passed ticks the engine has not looked at yet; which
		// of them start is the catch-up policy's (saga.Schedule.CatchUp):
		// Tick moves on to the first tick after now.
		sched, _ := def.Schedule()
		c, err := saga.ParseCron(sched.Cron)
		if err != nil {
			t.Fatalf("sagatest: Tick: %v", err)
		}
		after := c.Next(now)
		next = &after
	}
	if d := next.Sub(now); d > 0 {
		if err := e.Clock.Advance(ctx, d+time.Millisecond); err != nil {
			t.Fatalf("sagatest: Tick: %v", err)
		}
	}
	key := saga.TickKey(*next)
	deadline := time.Now().Add(e.cfg.Timeout)
	for {
		sg, err := e.Client.GetByKey(ctx, def.Name(), key)
		if err == nil {
			return e.Wait(t, sg.ID)
		}
		if !errors.Is(err, saga.ErrNotFound) {
			t.Fatalf("sagatest: Tick: read the saga of %s %q: %v", def.Name(), key, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("sagatest: Tick: no saga of %s %q after %s of wall time: is the schedule paused (Client.Schedules), or did its input refuse the tick?", def.Name(), key, e.cfg.Timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
