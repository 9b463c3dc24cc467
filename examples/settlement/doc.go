// Package settlement is the nightly settlement saga, a scheduled saga
// (saga.WithSchedule): every night at 02:00 UTC it totals the day before
// of a ledger table into one settlements row, then reports the total to
// a reporting service over HTTP.
//
//	settle (database step)  →  report (external step)
//	delete the settlement       withdraw the report
//
// The schedule starts one saga per night, under the tick's key
// (saga.TickKey, "tick:2026-12-03T02:00:00Z"), whatever the number of
// workers, with the input InputOf(tick): the UTC day before the tick.
// Nights missed while no worker ran are caught up when one starts again,
// the latest CatchUp (2) of them before the latest night due, oldest
// first; older ones are skipped, and their days can be settled by hand
// by starting the definition with an Input under a key of one's own.
//
// settle writes the settlements row, keyed by the day, with its step key,
// through sc.Tx: the row commits with the engine's record of the key, so
// a command delivered twice settles once, and a second saga for a day
// already settled (a manual start for a night the schedule did settle)
// fails for good with ErrSettledElsewhere and changes nothing. report
// posts the totals through saga/httpcall, its step key as the
// Idempotency-Key: an attempt whose answer was lost posts again under
// the same key, and the service answers with the report it kept. A
// report refused for good deletes the settlement (settle's compensation),
// so that the day can be settled again.
//
// In a binary:
//
//	def, err := settlement.NewDefinition(settlement.Config{ReportsURL: "http://127.0.0.1:9470"})
//	if err != nil {
//		log.Fatal(err)
//	}
//	service.Main(service.Config{
//		Name:        "ledger",
//		Definitions: []*saga.Definition{def},
//		Migrations:  []service.Migration{{Schema: settlement.Schema, Files: settlement.Migrations}},
//	})
//
// `schedules pause settlement --reason "quarter close"` stops the nightly
// starts in every worker (the nights meanwhile are skipped, never
// started); `schedules resume settlement` ticks again from the next night.
package settlement
