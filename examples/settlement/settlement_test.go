package settlement_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
	"github.com/idemsaga/idemsaga/service"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// reportService is a fake reporting service: it keeps one report per
// Idempotency-Key and answers a key posted again with it, refuses the
// days in refuse with 422, and withdraws a report (or voids its key) by
// POST /reports/{key}/withdraw.
type reportService struct {
	mu      sync.Mutex
	posts   int
	reports map[string]settlement.ReportRequest // by Idempotency-Key
	voided  map[string]bool
	refuse  map[string]bool
}

func newReportService(t *testing.T) (*reportService, *httptest.Server) {
	t.Helper()
	rs := &reportService{reports: map[string]settlement.ReportRequest{}, voided: map[string]bool{}, refuse: map[string]bool{}}
	srv := httptest.NewServer(rs)
	t.Cleanup(srv.Close)
	return rs, srv
}

func (rs *reportService) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	key := r.Header.Get("Idempotency-Key")
	answer := func(status int, rep settlement.Report) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(rep)
	}
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/reports":
		rs.posts++
		var req settlement.ReportRequest
		if key == "" || json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, "a report needs an Idempotency-Key and a JSON body", http.StatusBadRequest)
			return
		}
		if rs.voided[key] {
			http.Error(w, "this key's report was withdrawn", http.StatusConflict)
			return
		}
		if have, ok := rs.reports[key]; ok {
			answer(http.StatusOK, settlement.Report{ID: key, Day: have.Day})
			return
		}
		if rs.refuse[req.Day] {
			http.Error(w, "the books of "+req.Day+" are closed", http.StatusUnprocessableEntity)
			return
		}
		rs.reports[key] = req
		answer(http.StatusCreated, settlement.Report{ID: key, Day: req.Day})
	case r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/reports/") && strings.HasSuffix(r.URL.Path, "/withdraw"):
		forward := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/reports/"), "/withdraw")
		rep := rs.reports[forward]
		delete(rs.reports, forward)
		rs.voided[forward] = true
		answer(http.StatusOK, settlement.Report{ID: forward, Day: rep.Day})
	default:
		http.NotFound(w, r)
	}
}

// kept returns the reports kept, by day.
func (rs *reportService) kept() map[string]settlement.ReportRequest {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := map[string]settlement.ReportRequest{}
	for _, r := range rs.reports {
		out[r.Day] = r
	}
	return out
}

// newEnv runs the settlement saga, and extra definitions, in the test
// kit, against a fake reporting service.
func newEnv(t *testing.T, extra ...*saga.Definition) (*sagatest.Env, *saga.Definition, *reportService) {
	t.Helper()
	rs, srv := newReportService(t)
	def, err := settlement.NewDefinition(settlement.Config{ReportsURL: srv.URL})
	require.NoError(t, err)
	env := sagatest.New(t, sagatest.Config{
		Definitions: append([]*saga.Definition{def}, extra...),
		Migrations:  []service.Migration{{Schema: settlement.Schema, Files: settlement.Migrations}},
	})
	return env, def, rs
}

// schedule returns the recorded schedule of definition.
func schedule(t *testing.T, env *sagatest.Env, definition string) engine.ScheduleInfo {
	t.Helper()
	list, err := env.Client.Schedules(context.Background())
	require.NoError(t, err)
	for _, s := range list {
		if s.Definition == definition {
			return s
		}
	}
	t.Fatalf("no schedule recorded for %s", definition)
	return engine.ScheduleInfo{}
}

// book writes a ledger row.
func book(t *testing.T, env *sagatest.Env, account string, amount int64, at time.Time) {
	t.Helper()
	_, err := env.Pool.Exec(context.Background(), `insert into settlement.ledger (account, amount, booked_at) values ($1, $2, $3)`, account, amount, at)
	require.NoError(t, err)
}

type settled struct {
	Day            string
	Entries, Total int64
	Key            string
}

// settlements returns the settlements rows, by day.
func settlements(t *testing.T, env *sagatest.Env) []settled {
	t.Helper()
	rows, err := env.Pool.Query(context.Background(), `select day::text, entries, total, step_key::text from settlement.settlements order by day`)
	require.NoError(t, err)
	defer rows.Close()
	var out []settled
	for rows.Next() {
		var s settled
		require.NoError(t, rows.Scan(&s.Day, &s.Entries, &s.Total, &s.Key))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// sagaKeys returns the keys of the settlement sagas, sorted.
func sagaKeys(t *testing.T, env *sagatest.Env) []string {
	t.Helper()
	list, err := env.Client.List(context.Background(), engine.ListOptions{Definition: settlement.DefinitionName})
	require.NoError(t, err)
	out := []string{}
	for _, sg := range list {
		out = append(out, sg.Key)
	}
	slices.Sort(out)
	return out
}

// waitTick waits for the saga of tick to exist, then for its end.
func waitTick(t *testing.T, env *sagatest.Env, tick time.Time) *saga.Instance {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		sg, err := env.Client.GetByKey(context.Background(), settlement.DefinitionName, saga.TickKey(tick))
		if err == nil {
			return env.Wait(t, sg.ID)
		}
		require.ErrorIs(t, err, saga.ErrNotFound)
		require.True(t, time.Now().Before(deadline), "no saga for the tick %s after 30 s", tick)
		time.Sleep(2 * time.Millisecond)
	}
}

func day(tick time.Time) string { return settlement.InputOf(tick).Day }

// Two nights: each tick settles the day before it, once, with its rows
// only (a row at midnight belongs to the day it starts), and reports
// that total once under the report step's key, though the settle
// command is delivered twice and the first report's answer is lost.
func TestTwoNightsSettleOnceEach(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, def, rs := newEnv(t)
	first := *schedule(t, env, settlement.DefinitionName).Next
	require.Equal(t, 2, first.Hour())
	d1 := first.Add(-26 * time.Hour) // midnight of the day the first tick settles
	d2 := d1.Add(24 * time.Hour)
	book(t, env, "acme", 999, d1.Add(-time.Second)) // the day before: neither night's
	book(t, env, "acme", 100, d1)
	book(t, env, "globex", 250, d1.Add(13*time.Hour))
	book(t, env, "acme", -50, d2.Add(-time.Second))
	book(t, env, "acme", 40, d2)
	book(t, env, "initech", 2, d2.Add(24*time.Hour-time.Second))
	book(t, env, "acme", 7, d2.Add(24*time.Hour)) // the third day: neither night's

	env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: settlement.StepSettle})
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: settlement.StepReport, Attempt: 1})
	night1 := env.Tick(t, def)
	require.Equal(t, settlement.StateReported, night1.State)
	require.Equal(t, saga.TickKey(first), night1.Key)
	require.Equal(t, 1, env.Fired(sagatest.DeliverTwice))
	require.Equal(t, 1, env.Fired(sagatest.LoseOutcome))

	night2 := env.Tick(t, def)
	require.Equal(t, settlement.StateReported, night2.State)
	require.Equal(t, saga.TickKey(first.Add(24*time.Hour)), night2.Key)

	require.Equal(t, []settled{
		{Day: day(first), Entries: 3, Total: 300, Key: saga.StepKey(night1.ID, settlement.StepSettle, saga.PhaseForward).String()},
		{Day: day(first.Add(24 * time.Hour)), Entries: 2, Total: 42, Key: saga.StepKey(night2.ID, settlement.StepSettle, saga.PhaseForward).String()},
	}, settlements(t, env))
	kept := rs.kept()
	require.Len(t, kept, 2)
	require.Equal(t, int64(300), kept[day(first)].Total)
	require.Equal(t, saga.StepKey(night1.ID, settlement.StepSettle, saga.PhaseForward), kept[day(first)].Settlement)
	require.Equal(t, int64(42), kept[day(first.Add(24*time.Hour))].Total)
	rs.mu.Lock()
	require.Equal(t, 3, rs.posts, "the first night's report posted twice under one key, the second's once")
	_, ok := rs.reports[saga.StepKey(night1.ID, settlement.StepReport, saga.PhaseForward).String()]
	rs.mu.Unlock()
	require.True(t, ok, "the report is kept under the report step's key")

	// The first night's tick started again by hand, with its input: the
	// same saga, nothing settled twice.
	again, err := env.Client.Start(ctx, def, night1.Key, settlement.InputOf(first))
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, night1.ID, again.ID)
	require.Len(t, settlements(t, env), 2)
	require.Equal(t, []string{saga.TickKey(first), saga.TickKey(first.Add(24 * time.Hour))}, sagaKeys(t, env))
}

// Workers down for four nights: the clock passes four ticks before the
// engine looks again (one move of the clock, so no pass sees the ticks
// in between). The latest night and the CatchUp (2) before it start,
// oldest first; the oldest is skipped for good, and its day is settled
// by hand. A second saga for a day already settled is refused.
func TestMissedNightsCatchUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, def, rs := newEnv(t)
	first := *schedule(t, env, settlement.DefinitionName).Next
	ticks := []time.Time{first, first.Add(24 * time.Hour), first.Add(48 * time.Hour), first.Add(72 * time.Hour)}
	for i, tick := range ticks {
		book(t, env, "acme", int64(10*(i+1)), tick.Add(-12*time.Hour)) // 14:00 of the day the tick settles
	}

	now, err := env.Clock.Now(ctx)
	require.NoError(t, err)
	require.NoError(t, env.Clock.Advance(ctx, ticks[3].Sub(now)+time.Hour))
	for _, tick := range ticks[1:] {
		sg := waitTick(t, env, tick)
		require.Equal(t, settlement.StateReported, sg.State)
	}
	// The caught-up ticks start in the pass that skipped the oldest: it
	// is decided.
	require.Equal(t, []string{saga.TickKey(ticks[1]), saga.TickKey(ticks[2]), saga.TickKey(ticks[3])}, sagaKeys(t, env))
	s := schedule(t, env, settlement.DefinitionName)
	require.True(t, s.LastTick.Equal(ticks[3]), "last tick %s", s.LastTick)
	require.True(t, s.LastStarted.Equal(ticks[3]))
	require.True(t, s.Next.Equal(ticks[3].Add(24*time.Hour)))
	got := settlements(t, env)
	require.Len(t, got, 3)
	for i, st := range got {
		require.Equal(t, day(ticks[i+1]), st.Day)
		require.Equal(t, int64(10*(i+2)), st.Total)
	}
	require.Len(t, rs.kept(), 3)

	// The skipped night, settled by hand under a key of the operator's.
	manual := env.Run(t, def, "manual:"+day(ticks[0]), settlement.Input{Day: day(ticks[0])})
	require.Equal(t, settlement.StateReported, manual.State)
	got = settlements(t, env)
	require.Len(t, got, 4)
	require.Equal(t, settled{Day: day(ticks[0]), Entries: 1, Total: 10,
		Key: saga.StepKey(manual.ID, settlement.StepSettle, saga.PhaseForward).String()}, got[0])

	// Another saga for a settled day changes nothing.
	twice := env.Run(t, def, "manual-again:"+day(ticks[1]), settlement.Input{Day: day(ticks[1])})
	require.Equal(t, saga.StateCompensated, twice.State)
	require.Contains(t, twice.Error, "settled already")
	require.Len(t, settlements(t, env), 4)
	require.Len(t, rs.kept(), 4)
}

// A paused schedule starts nothing: the nights that come due while it is
// paused are skipped, never started, and a resume ticks from the next
// night. The kit has no signal that its scheduler looked, so a second
// schedule, hourly, is the witness: two of its ticks started after the
// nights came due mean that a whole pass looked at the paused schedule.
func TestPausedScheduleStartsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	witness := saga.WithSchedule(saga.MustNew("witness", saga.Step{Name: "look", Reaches: "looked", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}),
		saga.Schedule{Cron: "@hourly"})
	env, def, rs := newEnv(t, witness)
	first := *schedule(t, env, settlement.DefinitionName).Next

	p, err := env.Client.PauseSchedule(ctx, settlement.DefinitionName, engine.Repair{Key: "close-2026-q4", Reason: "quarter close", By: "test"})
	require.NoError(t, err)
	require.False(t, p.Replayed)
	s := schedule(t, env, settlement.DefinitionName)
	require.NotNil(t, s.Paused)
	require.Equal(t, "quarter close", s.Paused.Reason)

	now, err := env.Clock.Now(ctx)
	require.NoError(t, err)
	require.NoError(t, env.Clock.Advance(ctx, first.Add(24*time.Hour).Sub(now)+time.Hour)) // two nights due
	witnessLooked(t, env)
	require.NoError(t, env.Clock.Advance(ctx, time.Hour))
	witnessLooked(t, env)

	require.Empty(t, sagaKeys(t, env), "no night started while paused")
	require.Empty(t, settlements(t, env))
	require.Empty(t, rs.kept())
	s = schedule(t, env, settlement.DefinitionName)
	require.True(t, s.Next.Equal(first), "the paused nights are still due, not started: next %s", s.Next)
	require.Nil(t, s.LastStarted)

	_, err = env.Client.ResumeSchedule(ctx, settlement.DefinitionName, engine.Repair{Key: "reopen-2026-q4", By: "test"})
	require.NoError(t, err)
	s = schedule(t, env, settlement.DefinitionName)
	require.Nil(t, s.Paused)
	require.True(t, s.Next.Equal(first.Add(48*time.Hour)), "after the resume, the next night: %s", s.Next)
	night := env.Tick(t, def)
	require.Equal(t, settlement.StateReported, night.State)
	require.Equal(t, []string{saga.TickKey(first.Add(48 * time.Hour))}, sagaKeys(t, env), "only the night after the resume")
	got := settlements(t, env)
	require.Len(t, got, 1)
	require.Equal(t, day(first.Add(48*time.Hour)), got[0].Day)
}

// witnessLooked waits until the hourly witness schedule has handled
// every tick due by now: its pass read the schedules after the clock
// moved.
func witnessLooked(t *testing.T, env *sagatest.Env) {
	t.Helper()
	now, err := env.Clock.Now(context.Background())
	require.NoError(t, err)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if s := schedule(t, env, "witness"); s.Next.After(now) {
			return
		}
		require.True(t, time.Now().Before(deadline), "the witness schedule is not handled after 30 s")
		time.Sleep(2 * time.Millisecond)
	}
}

// A report the service refuses for good deletes the day's settlement
// (settle's compensation), so that the day can be settled again.
func TestRefusedReportUnsettlesTheDay(t *testing.T) {
	t.Parallel()
	env, def, rs := newEnv(t)
	rs.mu.Lock()
	rs.refuse["2026-11-30"] = true
	rs.mu.Unlock()
	book(t, env, "acme", 500, time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC))

	sg := env.Run(t, def, "manual:2026-11-30", settlement.Input{Day: "2026-11-30"})
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "books of 2026-11-30 are closed")
	require.Empty(t, settlements(t, env), "the settlement is deleted")
	require.Empty(t, rs.kept())
	var ran []string
	for _, a := range sg.Attempts {
		ran = append(ran, fmt.Sprintf("%s %s %s", a.Step, a.Phase, a.Outcome))
	}
	// A report refused at its only attempt took no effect: it is not
	// withdrawn.
	require.Equal(t, []string{"settle forward succeeded", "report forward failed", "settle compensate succeeded"}, ran)
}

// Migrate creates the tables on a database without them, and
// CheckMigrated then finds them; before, it says to migrate.
func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := sagatest.Database(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	require.ErrorContains(t, settlement.CheckMigrated(ctx, conn.Conn()), "apply the migrations")
	require.NoError(t, settlement.Migrate(ctx, conn.Conn()))
	require.NoError(t, settlement.Migrate(ctx, conn.Conn()), "again: nothing to do")
	require.NoError(t, settlement.CheckMigrated(ctx, conn.Conn()))
}
