package saga

import (
	"fmt"
	"time"
)

// WithDeadline returns a copy of d whose sagas each have a deadline: a
// saga that has not finished within deadline of its start (on the
// database's clock) is cancelled and compensated as Client.Cancel does,
// by the reaper of a process that runs d, and the cancel is recorded as a
// repair by "deadline". A saga already compensating, or parked for a
// person, is left as it is. While a saga or its definition is paused its
// deadline does not fire; once resumed, a saga past its deadline is
// cancelled at the reaper's next pass. A deadline is part of the
// definition's Description. It panics on a deadline that is not positive.
//
//	def := saga.WithDeadline(saga.MustNew("order", steps...), 15*time.Minute)
func WithDeadline(d *Definition, deadline time.Duration) *Definition {
	if deadline <= 0 {
		panic(fmt.Sprintf("saga: WithDeadline(%q, %s): the deadline must be positive", d.name, deadline))
	}
	c := *d
	c.deadline = deadline
	return &c
}

// Deadline returns the time a saga of d has to finish (WithDeadline), or
// 0 for none.
func (d *Definition) Deadline() time.Duration { return d.deadline }
