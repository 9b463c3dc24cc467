package transfer

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Schema holds the example's tables.
const Schema = "transfer"

// Migrate creates or updates the transfer tables.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fsSub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	return migrations.Apply(ctx, conn, Schema, sub)
}

// CheckMigrated fails when the database lacks some of the transfer
// tables' migrations: the steps' statements call functions they create
// (a debit without migration 005's would fail every time).
func CheckMigrated(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fsSub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	_, _, err = migrations.CheckApplied(ctx, conn, Schema, sub)
	return err
}

// Input is a transfer's saga input.
type Input struct {
	From   int64 `json:"from"`
	To     int64 `json:"to"`
	Amount int64 `json:"amount"`
}

// Validate rejects a transfer that can never succeed, before anything is
// written.
func (in Input) Validate() error {
	switch {
	case in.Amount <= 0:
		return fmt.Errorf("transfer: amount must be positive, got %d", in.Amount)
	case in.From == in.To:
		return fmt.Errorf("transfer: source and destination are the same account (%d)", in.From)
	}
	return nil
}

// Entry is what a step reports: the ledger line it wrote.
type Entry struct {
	Account int64 `json:"account"`
	Amount  int64 `json:"amount"`
}

// Errors a transfer can end with. They are permanent: retrying cannot help.
var (
	ErrInsufficientFunds  = errors.New("insufficient funds")
	ErrSourceUnavailable  = errors.New("source account missing or frozen")
	ErrDestinationMissing = errors.New("destination account missing or frozen")
)

// Step and state names.
const (
	StepDeduct               = "deduct"
	StepCredit               = "credit"
	StepRefund               = "refund"
	StateDeducted saga.State = "deducted"
	StateCredited saga.State = "credited"
)

// NewDefinition returns the transfer saga with the given retry policy for
// every step (zero fields take the defaults).
func NewDefinition(policy saga.RetryPolicy) (*saga.Definition, error) {
	return saga.New("transfer",
		saga.Step{
			Name:            StepDeduct,
			Reaches:         StateDeducted,
			Forward:         saga.Handle(deduct),
			Compensate:      saga.Handle(refund),
			Retry:           policy,
			CompensateRetry: policy,
			// Every effect of both steps is a write in the step's
			// transaction, one statement sent by ExecLast: it travels
			// with the step's inbox claim and its success, in one round
			// trip.
			TxOnly: true,
		},
		saga.Step{
			Name:    StepCredit,
			Reaches: StateCredited,
			Forward: saga.Handle(credit),
			Retry:   policy,
			TxOnly:  true,
		},
	)
}

// Definition is the transfer saga with default retry policies.
var Definition = func() *saga.Definition {
	d, err := NewDefinition(saga.RetryPolicy{})
	if err != nil {
		panic(err)
	}
	return d
}()

func deduct(ctx context.Context, sc *saga.StepContext, in Input) (Entry, error) {
	if err := in.Validate(); err != nil {
		return Entry{}, saga.Permanent(err)
	}
	// The saga ID goes as a [16]byte, which pgx writes as a uuid directly; a
	// uuid.UUID would go through its driver.Valuer, as text parsed back.
	// The debit is the step's only statement: it travels with the step's
	// claim and success, in one round trip, and fails unless it took effect.
	err := sc.ExecLast(ctx, debitSQL, in.From, in.Amount, [16]byte(sc.SagaID), StepDeduct)
	switch refusal(err) {
	case "":
	case codeSourceUnavailable:
		return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrSourceUnavailable, in.From))
	case codeInsufficientFunds:
		return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d cannot pay %d", ErrInsufficientFunds, in.From, in.Amount))
	default:
		return Entry{}, fmt.Errorf("debit account %d: %w", in.From, err)
	}
	return Entry{Account: in.From, Amount: -in.Amount}, nil
}

func credit(ctx context.Context, sc *saga.StepContext, in Input) (Entry, error) {
	err := sc.ExecLast(ctx, creditSQL, in.To, in.Amount, [16]byte(sc.SagaID), StepCredit)
	switch refusal(err) {
	case "":
	case codeDestinationMissing:
		return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrDestinationMissing, in.To))
	default:
		return Entry{}, fmt.Errorf("credit account %d: %w", in.To, err)
	}
	return Entry{Account: in.To, Amount: in.Amount}, nil
}

// refusal returns the code of a transfer.refuse raise in err, "" for no
// error, and "?" for any other error.
func refusal(err error) string {
	if err == nil {
		return ""
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "TR") {
		return pgErr.Code
	}
	return "?"
}

func refund(ctx context.Context, sc *saga.StepContext, in Input) (Entry, error) {
	// Refund what the deduction took, as recorded in its result.
	var taken Entry
	if ok, err := sc.DecodeResult(StepDeduct, &taken); err != nil {
		return Entry{}, err
	} else if !ok {
		taken = Entry{Account: in.From, Amount: -in.Amount}
	}
	// A refund must land even on a frozen account: it returns the
	// customer's own money.
	tag, err := sc.Tx.Exec(ctx, refundSQL, taken.Account, -taken.Amount, [16]byte(sc.SagaID), StepRefund)
	if err != nil {
		return Entry{}, fmt.Errorf("refund account %d: %w", taken.Account, err)
	}
	if tag.RowsAffected() == 0 {
		return Entry{}, saga.Permanent(fmt.Errorf("refund: account %d no longer exists", taken.Account))
	}
	return Entry{Account: taken.Account, Amount: -taken.Amount}, nil
}
