package settlement

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/saga/httpcall"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered .sql files of the tables, in its
// migrations folder (for service.Migration and sagatest).
var Migrations fs.FS = migrationFiles

// Schema holds the example's tables.
const Schema = "settlement"

// Migrate creates or updates the settlement tables.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	return migrations.Apply(ctx, conn, Schema, sub)
}

// CheckMigrated fails when the database lacks the settlement tables of
// this build, saying to apply the migrations.
func CheckMigrated(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	_, _, err = migrations.CheckApplied(ctx, conn, Schema, sub)
	return err
}

// Names of the definition, its steps and states.
const (
	DefinitionName            = "settlement"
	StepSettle                = "settle"
	StepReport                = "report"
	StateSettled   saga.State = "settled"
	StateReported  saga.State = "reported"
)

// dayLayout is how an Input names its day.
const dayLayout = "2006-01-02"

// Cron is the settlement's schedule: every night at 02:00 UTC, once the
// day before has closed.
const Cron = "0 2 * * *"

// CatchUp is how many nights missed while no worker ran are settled when
// one starts again, before the latest night due, which always is: two
// nights lost to an outage are settled, oldest first. A night older than
// that is skipped for good (schedule_ticks_total{outcome="skipped"}); its
// ledger rows stay unsettled until someone starts a saga for its day by
// hand, under a key of their own.
const CatchUp = 2

// Input is a settlement's input: the day it settles.
type Input struct {
	// Day is the UTC day settled, as 2006-01-02: the ledger rows booked
	// from its midnight to the next.
	Day string `json:"day"`
}

// Validate rejects a day that is not a date.
func (in Input) Validate() error {
	_, err := in.day()
	return err
}

func (in Input) day() (time.Time, error) {
	d, err := time.Parse(dayLayout, in.Day)
	if err != nil {
		return time.Time{}, fmt.Errorf("settlement: day %q is not a date like 2026-12-31", in.Day)
	}
	return d, nil
}

// InputOf returns the input of the saga the tick at tick starts: the UTC
// day before the tick, which the 02:00 tick settles.
func InputOf(tick time.Time) Input {
	return Input{Day: tick.UTC().AddDate(0, 0, -1).Format(dayLayout)}
}

// Settlement is the settle step's result: the day's totals, as recorded.
type Settlement struct {
	Day     string `json:"day"`
	Entries int64  `json:"entries"`
	Total   int64  `json:"total"`
}

// ReportRequest is what the report step posts to the reporting service,
// under the step's key as its Idempotency-Key.
type ReportRequest struct {
	Day     string `json:"day"`
	Entries int64  `json:"entries"`
	Total   int64  `json:"total"`
	// Settlement is the key of the settle step that recorded the totals.
	Settlement uuid.UUID `json:"settlement"`
}

// Report is the reporting service's answer to a report, and the report
// step's result.
type Report struct {
	ID  string `json:"id"`
	Day string `json:"day"`
}

// ErrSettledElsewhere: the day is settled already, by another saga's key.
var ErrSettledElsewhere = errors.New("settlement: the day is settled already by another saga")

// Config configures the settlement saga.
type Config struct {
	// ReportsURL is the reporting service's base URL, such as
	// http://127.0.0.1:9470. Required. The service takes POST /reports
	// (201 reported, 200 the key reported before, 422 or 409 refused for
	// good) and POST /reports/{key}/withdraw (200: the report under the
	// key withdrawn, or the key voided if none came, so that a late
	// report under it is refused with 409).
	ReportsURL string
	// Transport sends the calls (httpcall.Client.Transport). Defaults to
	// http.DefaultTransport.
	Transport http.RoundTripper
	// Policy is every step's retry policy (zero fields take the
	// defaults).
	Policy saga.RetryPolicy
}

// NewDefinition returns the nightly settlement saga, started at every
// tick of Cron (saga.WithSchedule, CatchUp missed nights caught up) with
// InputOf(tick); it can also be started by hand with an Input, under a
// key of the caller's.
//
//	settle (database step)  →  report (external step)
//	delete the settlement       withdraw the report
func NewDefinition(cfg Config) (*saga.Definition, error) {
	if cfg.ReportsURL == "" {
		return nil, errors.New("settlement: Config.ReportsURL is required: the reporting service's base URL")
	}
	r := &reports{base: strings.TrimRight(cfg.ReportsURL, "/"), calls: &httpcall.Client{Transport: cfg.Transport}}
	d, err := saga.New(DefinitionName,
		saga.Step{
			Name: StepSettle, Reaches: StateSettled, Kind: saga.DatabaseStep,
			Forward: saga.Handle(settle), Compensate: saga.Handle(unsettle),
			Retry: cfg.Policy, CompensateRetry: cfg.Policy,
		},
		saga.Step{
			Name: StepReport, Reaches: StateReported, Kind: saga.ExternalStep,
			Forward: saga.Handle(r.report), Compensate: saga.Handle(r.withdraw),
			Retry: cfg.Policy, CompensateRetry: cfg.Policy,
		},
	)
	if err != nil {
		return nil, err
	}
	return saga.WithSchedule(saga.WithInput(d, Input.Validate), saga.Schedule{
		Cron:      Cron,
		CatchUp:   CatchUp,
		InputFunc: func(tick time.Time) (any, error) { return InputOf(tick), nil },
	}), nil
}

// settle totals the day's ledger rows into its settlements row, under the
// step's key, in the step's transaction: it commits once with the key's
// record. A day a saga of another key settled is refused for good.
func settle(ctx context.Context, sc *saga.StepContext, in Input) (Settlement, error) {
	day, err := in.day()
	if err != nil {
		return Settlement{}, saga.Permanent(err)
	}
	var key uuid.UUID
	s := Settlement{Day: in.Day}
	err = sc.Tx.QueryRow(ctx, settleSQL, in.Day, day, day.AddDate(0, 0, 1), sc.Key, sc.SagaID).Scan(&key, &s.Entries, &s.Total)
	if err != nil {
		return Settlement{}, fmt.Errorf("settle %s: %w", in.Day, err)
	}
	if key != sc.Key {
		return Settlement{}, saga.Permanent(fmt.Errorf("%w: %s was settled under step key %s", ErrSettledElsewhere, in.Day, key))
	}
	return s, nil
}

// unsettle deletes the day's settlements row that the forward step wrote,
// by its key: another saga's row for the day is left alone.
func unsettle(ctx context.Context, sc *saga.StepContext, in Input) (Settlement, error) {
	s := Settlement{Day: in.Day}
	err := sc.Tx.QueryRow(ctx, unsettleSQL, sc.ForwardKey).Scan(&s.Entries, &s.Total)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil // nothing was settled under the key
	}
	if err != nil {
		return s, fmt.Errorf("delete the settlement of %s: %w", in.Day, err)
	}
	return s, nil
}

// reports calls the reporting service.
type reports struct {
	base  string
	calls *httpcall.Client
}

// report posts the day's totals, as settle recorded them, under the
// step's key. A 422 or 409 is a refusal for good; anything else that is
// not a success leaves the attempt unknown, and the next one posts again
// under the same key, which the service answers with what it did.
func (r *reports) report(ctx context.Context, sc *saga.StepContext, in Input) (Report, error) {
	var s Settlement
	ok, err := sc.DecodeResult(StepSettle, &s)
	if err != nil {
		return Report{}, err
	}
	if !ok {
		return Report{}, saga.Permanent(fmt.Errorf("report %s: the settle step left no totals", in.Day))
	}
	res, err := r.calls.Do(ctx, sc, httpcall.Call{
		Method: http.MethodPost, URL: r.base + "/reports",
		JSON:    ReportRequest{Day: s.Day, Entries: s.Entries, Total: s.Total, Settlement: saga.StepKey(sc.SagaID, StepSettle, saga.PhaseForward)},
		Success: []int{http.StatusCreated, http.StatusOK},
		Refused: []int{http.StatusUnprocessableEntity, http.StatusConflict},
	})
	if err != nil {
		return Report{}, fmt.Errorf("report the settlement of %s: %w", in.Day, err)
	}
	var rep Report
	return rep, res.Decode(&rep)
}

// withdraw withdraws the report posted under the forward key, or voids
// the key if none came, so that a late report under it is refused: it
// runs when the report was refused after an attempt whose outcome was
// unknown, or given up with one.
func (r *reports) withdraw(ctx context.Context, sc *saga.StepContext, in Input) (Report, error) {
	res, err := r.calls.Do(ctx, sc, httpcall.Call{
		Method: http.MethodPost, URL: r.base + "/reports/" + sc.ForwardKey.String() + "/withdraw",
		Success: []int{http.StatusOK},
	})
	if err != nil {
		return Report{}, fmt.Errorf("withdraw the report of %s: %w", in.Day, err)
	}
	var rep Report
	return rep, res.Decode(&rep)
}
