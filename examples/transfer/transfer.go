package transfer

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered .sql files of the tables, in its
// migrations folder (for service.Migration and sagatest).
var Migrations fs.FS = migrationFiles

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

// CheckMigrated fails when the database lacks the transfer tables of this
// build, saying to apply the migrations.
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
// every step (zero fields take the defaults). Both steps are database
// steps: their whole effect is a write through sc.Tx. Its input is an
// Input, decoded strictly and validated at every start.
func NewDefinition(policy saga.RetryPolicy) (*saga.Definition, error) {
	d, err := saga.New("transfer",
		saga.Step{
			Name:            StepDeduct,
			Reaches:         StateDeducted,
			Kind:            saga.DatabaseStep,
			Forward:         saga.Handle(deduct),
			Compensate:      saga.Handle(refund),
			Retry:           policy,
			CompensateRetry: policy,
		},
		saga.Step{
			Name:    StepCredit,
			Reaches: StateCredited,
			Kind:    saga.DatabaseStep,
			Forward: saga.Handle(credit),
			Retry:   policy,
		},
	)
	if err != nil {
		return nil, err
	}
	return saga.WithInput(d, Input.Validate), nil
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
	// sc.Tx also records sc.Key in the inbox: this write commits once, or
	// not at all.
	tag, err := sc.Tx.Exec(ctx, debitSQL, in.From, in.Amount, sc.SagaID, StepDeduct)
	if err != nil {
		return Entry{}, fmt.Errorf("debit account %d: %w", in.From, err) // retried
	}
	if tag.RowsAffected() == 0 {
		var frozen bool
		err := sc.Tx.QueryRow(ctx, accountState, in.From).Scan(&frozen)
		switch {
		case errors.Is(err, pgx.ErrNoRows) || err == nil && frozen:
			return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrSourceUnavailable, in.From))
		case err != nil:
			return Entry{}, fmt.Errorf("read account %d: %w", in.From, err)
		}
		return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d cannot pay %d", ErrInsufficientFunds, in.From, in.Amount))
	}
	return Entry{Account: in.From, Amount: -in.Amount}, nil
}

func credit(ctx context.Context, sc *saga.StepContext, in Input) (Entry, error) {
	tag, err := sc.Tx.Exec(ctx, creditSQL, in.To, in.Amount, sc.SagaID, StepCredit)
	if err != nil {
		return Entry{}, fmt.Errorf("credit account %d: %w", in.To, err)
	}
	if tag.RowsAffected() == 0 {
		return Entry{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrDestinationMissing, in.To))
	}
	return Entry{Account: in.To, Amount: in.Amount}, nil
}

func refund(ctx context.Context, sc *saga.StepContext, in Input) (Entry, error) {
	// Refund what the deduction took, as recorded in its result.
	var taken Entry
	if ok, err := sc.DecodeResult(StepDeduct, &taken); err != nil {
		return Entry{}, err
	} else if !ok {
		taken = Entry{Account: in.From, Amount: -in.Amount}
	}
	tag, err := sc.Tx.Exec(ctx, refundSQL, taken.Account, -taken.Amount, sc.SagaID, StepRefund)
	if err != nil {
		return Entry{}, fmt.Errorf("refund account %d: %w", taken.Account, err)
	}
	if tag.RowsAffected() == 0 {
		return Entry{}, saga.Permanent(fmt.Errorf("refund: account %d no longer exists", taken.Account))
	}
	return Entry{Account: taken.Account, Amount: -taken.Amount}, nil
}
