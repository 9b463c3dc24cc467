package settlement_test

import (
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/saga"
)

// The night's tick names its saga and the day it settles: the 02:00 tick
// of December 3rd settles December 2nd, under the tick's key, whichever
// worker starts it.
func Example() {
	def, err := settlement.NewDefinition(settlement.Config{ReportsURL: "http://127.0.0.1:9470"})
	if err != nil {
		panic(err)
	}
	s, _ := def.Schedule()
	fmt.Println(s.Cron, "catch-up", s.CatchUp)

	tick := time.Date(2026, 12, 3, 2, 0, 0, 0, time.UTC)
	fmt.Println(saga.TickKey(tick), settlement.InputOf(tick).Day)
	_, err = def.Input([]byte(`{"day":"yesterday"}`))
	fmt.Println(err)
	// Output:
	// 0 2 * * * catch-up 2
	// tick:2026-12-03T02:00:00Z 2026-12-02
	// idemsaga: invalid input for saga "settlement": settlement: day "yesterday" is not a date like 2026-12-31
}
