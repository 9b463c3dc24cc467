package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/saga"
)

// chaosDriver is a workload that moves on its own rather than by jobs
// submitted: the settlement's nights, started by its schedule.
type chaosDriver interface {
	// drive runs until the workload is all there (every night passed);
	// it may hold the workers down for a while.
	drive(ctx context.Context, pool *pgxpool.Pool, workers *workerSet, nWorkers int) error
	// progress is the share done, 1 once everything finished.
	progress(ctx context.Context, pool *pgxpool.Pool) float64
}

// settlementChaos runs the nightly settlement on a clock that passes a
// night every nightEvery: the database's idemsaga.now() runs ahead of
// the wall by a whole day at each step, so every lease and backoff in
// flight expires at once, as after a long stall. A third of the way
// through, every worker is killed and kept down for outage nights: the
// schedule catches up the latest CatchUp of them on return and skips
// the older ones. The reporting service loses answers after keeping
// reports, fails requests before, and answers some late.
type settlementChaos struct {
	nights   int
	outage   int
	start    time.Time // the database's clock when a worker recorded the schedule
	svc      *reportService
	srv      *http.Server
	url      string
	passed   atomic.Int64 // nights the clock passed
	downFrom atomic.Int64 // the first night of the outage, -1 before it
	downTo   atomic.Int64 // the last night of the outage
}

const (
	nightEvery        = time.Second
	settlementOutage  = 5
	settlementEntries = 20 // ledger rows per day
)

func (w *settlementChaos) prepare(ctx context.Context, pool *pgxpool.Pool, seed uint64) error {
	w.outage = settlementOutage
	w.downFrom.Store(-1)
	w.downTo.Store(-1)
	// The clock: the database's, plus an offset the run moves.
	if _, err := pool.Exec(ctx, `create schema chaosclock;
create table chaosclock.clock (offset_ms bigint not null);
insert into chaosclock.clock values (0);
create or replace function idemsaga.now() returns timestamptz language sql stable parallel safe
as $$ select pg_catalog.now() + (select offset_ms from chaosclock.clock) * interval '1 millisecond' $$`); err != nil {
		return fmt.Errorf("install the chaos clock: %w", err)
	}
	var now time.Time
	if err := pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&now); err != nil {
		return err
	}
	// Every day the run can settle has its business.
	rng := rand.New(rand.NewPCG(seed, 5))
	b := &pgx.Batch{}
	first := now.UTC().Truncate(24*time.Hour).AddDate(0, 0, -2)
	for d := range w.nights + 4 {
		for i := range settlementEntries {
			at := first.AddDate(0, 0, d).Add(time.Duration(rng.Int64N(int64(24 * time.Hour))))
			b.Queue(`insert into settlement.ledger (account, amount, booked_at) values ($1, $2, $3)`, fmt.Sprintf("acct-%d", i%7), rng.Int64N(20_000)-5_000, at)
		}
	}
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("seed the ledger: %w", err)
	}
	w.svc = newReportService(seed)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	w.url = "http://" + ln.Addr().String()
	w.srv = &http.Server{Handler: w.svc, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = w.srv.Serve(ln) }()
	return nil
}

func (w *settlementChaos) env() []string {
	return []string{"IDEMSAGA_SETTLEMENT=true", "IDEMSAGA_REPORTS_URL=" + w.url}
}

// args keeps every saga: retention counts on the clock, which passes a
// week every seven nights.
func (w *settlementChaos) args() []string         { return []string{"--no-retention"} }
func (w *settlementChaos) count(c *chaosCmd) int  { return c.Nights }
func (w *settlementChaos) connect(*engine.Client) {}
func (w *settlementChaos) jobs(int, uint64) []chaosJob {
	return nil
}

func (w *settlementChaos) describe() {
	fmt.Printf("  reporting service at %s: 5%% of answers lost after the report was kept, 4%% 500 before, 2%% answered after the step timeout; one day in six refused (its saga is compensated)\n", w.url)
	fmt.Printf("  a night passes every %s on the database's clock; every worker is down for %d nights a third of the way through\n", nightEvery, w.outage)
}

func (w *settlementChaos) close() {
	if w.srv != nil {
		_ = w.srv.Close()
	}
}

func (w *settlementChaos) definition(p saga.RetryPolicy) (*saga.Definition, error) {
	return settlement.NewDefinition(settlement.Config{ReportsURL: w.url, Policy: p})
}

func (w *settlementChaos) drive(ctx context.Context, pool *pgxpool.Pool, workers *workerSet, nWorkers int) error {
	// The nights start once a worker recorded the schedule: it is due
	// from then on, and a night passed before would not be.
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := pool.QueryRow(ctx, `select created_at from idemsaga.schedules where definition = $1`, settlement.DefinitionName).Scan(&w.start)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if time.Now().After(deadline) {
			return errors.New("no worker recorded the settlement's schedule within 60s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	down := max(1, w.nights/3)
	for night := 1; night <= w.nights; night++ {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(nightEvery):
		}
		if night == down {
			// The night before's tick started before the outage: the
			// outage's nights are the ones without a worker.
			if err := w.waitLastTick(ctx, pool); err != nil {
				return err
			}
			workers.hold(true)
			workers.killAll()
			w.downFrom.Store(int64(night))
			fmt.Printf("  night %d: every worker killed, and kept down for %d nights\n", night, w.outage)
		}
		if _, err := pool.Exec(ctx, `update chaosclock.clock set offset_ms = offset_ms + $1`, (24 * time.Hour).Milliseconds()); err != nil {
			return fmt.Errorf("move the clock: %w", err)
		}
		w.passed.Store(int64(night))
		if night == down+w.outage-1 {
			w.downTo.Store(int64(night))
			workers.hold(false)
			for range nWorkers {
				if err := workers.start(); err != nil {
					return err
				}
			}
			// The clock waits for their first pass, so the nights it
			// catches up are the outage's last ones.
			if err := w.waitLastTick(ctx, pool); err != nil {
				return err
			}
			fmt.Printf("  night %d: workers back\n", night)
		}
	}
	// The last night's saga starts before the run counts what finished.
	return w.waitLastTick(ctx, pool)
}

func (w *settlementChaos) progress(ctx context.Context, pool *pgxpool.Pool) float64 {
	p := float64(w.passed.Load()) / float64(w.nights)
	var running int
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running); err != nil || running > 0 {
		return min(p, 0.999)
	}
	return p
}

func (w *settlementChaos) check(ctx context.Context, pool *pgxpool.Pool, def *saga.Definition, fig *chaosFigures) error {
	res, err := reconcile(ctx, pool, []*saga.Definition{def}, 5*time.Second, 0)
	if err != nil {
		return err
	}
	for _, d := range res.Differences {
		fig.Differences = append(fig.Differences, d.String())
	}
	kept, counts := w.svc.kept()
	byKey := map[uuid.UUID]settlement.ReportRequest{}
	perDay := map[string]int{}
	for k, r := range kept {
		id, err := uuid.Parse(k)
		if err != nil {
			fig.Differences = append(fig.Differences, "a report kept under "+k+", not a step key")
			continue
		}
		byKey[id] = r
		perDay[r.Day]++
	}
	for day, n := range perDay {
		if n > 1 {
			fig.Differences = append(fig.Differences, fmt.Sprintf("%d reports kept for %s", n, day))
		}
	}
	// Each saga against the settlements and the reports.
	rows, err := pool.Query(ctx, `select s.id, s.state::text, s.idem_key, s.input->>'day', coalesce(s.error, ''),
  st.step_key, st.entries, st.total,
  (select count(*) from settlement.ledger l where l.booked_at >= (s.input->>'day')::date and l.booked_at < (s.input->>'day')::date + 1),
  (select coalesce(sum(amount), 0) from settlement.ledger l where l.booked_at >= (s.input->>'day')::date and l.booked_at < (s.input->>'day')::date + 1)
from idemsaga.sagas s left join settlement.settlements st on st.saga_id = s.id
where s.definition = $1 order by s.idem_key`, settlement.DefinitionName)
	if err != nil {
		return err
	}
	type row struct {
		id                   uuid.UUID
		state, key, day, err string
		settledKey           *uuid.UUID
		entries, total       *int64
		wantEntries, wantSum int64
	}
	sagas, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.id, &x.state, &x.key, &x.day, &x.err, &x.settledKey, &x.entries, &x.total, &x.wantEntries, &x.wantSum)
		return x, err
	})
	if err != nil {
		return err
	}
	fig.ByState = map[string]int{}
	nights := map[string]bool{}
	for _, s := range sagas {
		fig.ByState[s.state]++
		nights[s.day] = true
		settleKey := saga.StepKey(s.id, settlement.StepSettle, saga.PhaseForward)
		reportKey := saga.StepKey(s.id, settlement.StepReport, saga.PhaseForward)
		rep, reported := byKey[reportKey]
		switch s.state {
		case string(settlement.StateReported):
			switch {
			case closedBooks(s.day):
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s reported %s, whose books are closed", s.id, s.day))
			case s.settledKey == nil || *s.settledKey != settleKey:
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s reported %s without its settlement", s.id, s.day))
			case *s.entries != s.wantEntries || *s.total != s.wantSum:
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s settled %s as %d entries, %d; the ledger holds %d, %d", s.id, s.day, *s.entries, *s.total, s.wantEntries, s.wantSum))
			case !reported || rep.Day != s.day || rep.Total != *s.total || rep.Entries != *s.entries || rep.Settlement != settleKey:
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s reported %s, and the service keeps %+v under its key", s.id, s.day, rep))
			}
		case string(saga.StateCompensated):
			if !closedBooks(s.day) {
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s of %s compensated, and the service refuses no report of that day: %s", s.id, s.day, s.err))
			}
			if s.settledKey != nil || reported {
				fig.Differences = append(fig.Differences, fmt.Sprintf("saga %s compensated, but its settlement (%v) or its report (%t) stands", s.id, s.settledKey, reported))
			}
		}
	}
	fig.Sagas = len(sagas)
	fig.Credited, fig.Compensated, fig.Failed = fig.ByState[string(settlement.StateReported)], fig.ByState["compensated"], fig.ByState["failed"]
	// Nights without a saga: only those the outage's catch-up skipped,
	// the older ones of the outage.
	var missed []string
	from, to := w.downFrom.Load(), w.downTo.Load()
	for night := int64(1); night <= int64(w.nights); night++ {
		tick := w.start.UTC().Truncate(24*time.Hour).Add(2*time.Hour).AddDate(0, 0, int(night))
		if tick.Before(w.start) {
			continue // not due yet when the schedule was recorded
		}
		day := settlement.InputOf(tick).Day
		if nights[day] {
			continue
		}
		// The clock passed tick during night n's step if tick <= start + n days.
		n := int64(tick.Sub(w.start)/(24*time.Hour)) + 1
		if n >= from && n <= to-int64(settlement.CatchUp)-1 {
			missed = append(missed, day)
			continue
		}
		if n <= int64(w.passed.Load()) {
			fig.Differences = append(fig.Differences, fmt.Sprintf("night %s (tick %s) has no saga, and no worker was down at it", day, tick.Format(time.RFC3339)))
		}
	}
	fig.Extra = append(fig.Extra,
		fmt.Sprintf("nights             %d sagas over %d nights: reported %d, compensated %d, failed %d; %d nights skipped by the catch-up after the outage %v",
			len(sagas), w.nights, fig.Credited, fig.Compensated, fig.Failed, len(missed), missed),
		fmt.Sprintf("reporting service  %d posts, %d reports kept, %d replays of a key, %d refused (books closed), %d withdrawn, %d answers lost after keeping, %d 500s before, %d slow answers",
			counts.Posts, counts.Kept, counts.Replays, counts.Refused, counts.Withdrawn, counts.Lost, counts.Failed, counts.Slow))
	if len(sagas) == 0 {
		return errors.New("no settlement saga ran")
	}
	return nil
}

// waitLastTick waits until the latest tick the clock passed has its saga.
func (w *settlementChaos) waitLastTick(ctx context.Context, pool *pgxpool.Pool) error {
	var now time.Time
	if err := pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&now); err != nil {
		return err
	}
	tick := now.UTC().Truncate(24 * time.Hour).Add(2 * time.Hour)
	if tick.After(now) {
		tick = tick.AddDate(0, 0, -1)
	}
	if tick.Before(w.start) {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1 and idem_key = $2`, settlement.DefinitionName, saga.TickKey(tick)).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no saga for the tick %s within 30s, before the outage", tick.Format(time.RFC3339))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
