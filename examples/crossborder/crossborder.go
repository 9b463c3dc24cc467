package crossborder

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered .sql files of the tables, in its
// migrations folder (for service.Migration and sagatest).
var Migrations fs.FS = func() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	return sub
}()

// Schema holds the example's tables.
const Schema = "crossborder"

// Migrate creates or updates the example's tables.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	return migrations.Apply(ctx, conn, Schema, Migrations)
}

// Names of the definitions, their steps and states.
const (
	DefinitionName = "crossborder"
	FXName         = "fx"

	StepDebit  = "debit"
	StepFX     = "fx"
	StepCredit = "credit"
	StepQuote  = "quote"
	// StepConvert is the child's conversion at the desk.
	StepConvert = "convert"

	StateDebited   saga.State = "debited"
	StateConverted saga.State = "converted"
	StateCredited  saga.State = "credited"
	StateQuoted    saga.State = "quoted"
)

// Errors a transfer can end with. They are permanent: retrying cannot help.
var (
	ErrInsufficientFunds      = errors.New("insufficient funds")
	ErrSourceUnavailable      = errors.New("source account missing or frozen")
	ErrDestinationUnavailable = errors.New("destination account missing or frozen")
	ErrNoRate                 = errors.New("the desk quotes no rate for this pair")
	ErrDeskShort              = errors.New("the desk cannot pay the bought currency")
)

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// Input is a transfer's saga input: Amount, in the smallest unit of the
// source account's currency, from one account to another.
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
		return fmt.Errorf("crossborder: amount must be positive, got %d", in.Amount)
	case in.From == in.To:
		return fmt.Errorf("crossborder: source and destination are the same account (%d)", in.From)
	}
	return nil
}

// Debit is the debit's result: what it took, and in which currencies the
// two accounts are held (the fx step's condition reads them).
type Debit struct {
	Account    int64  `json:"account"`
	Amount     int64  `json:"amount"`
	Currency   string `json:"currency"`
	ToCurrency string `json:"to_currency"`
}

// Credit is the credit's result: what the destination received.
type Credit struct {
	Account  int64  `json:"account"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// FXInput is the child's input: sell Amount of Sell for Buy.
type FXInput struct {
	Sell   string `json:"sell"`
	Buy    string `json:"buy"`
	Amount int64  `json:"amount"`
}

// Validate rejects a conversion that can never succeed.
func (in FXInput) Validate() error {
	switch {
	case !currencyCode.MatchString(in.Sell) || !currencyCode.MatchString(in.Buy):
		return fmt.Errorf("crossborder: currencies are three capital letters, got %q and %q", in.Sell, in.Buy)
	case in.Sell == in.Buy:
		return fmt.Errorf("crossborder: nothing to convert from %s to %s", in.Sell, in.Buy)
	case in.Amount <= 0:
		return fmt.Errorf("crossborder: amount must be positive, got %d", in.Amount)
	}
	return nil
}

// Quote is the quote's result, and Conversion the conversion's: the
// child's results, by step name, are the fx step's result (FXResult).
type Quote struct {
	Sell   string `json:"sell"`
	Buy    string `json:"buy"`
	Sold   int64  `json:"sold"`
	Bought int64  `json:"bought"`
	Micros int64  `json:"micros"`
}

// Conversion is what the desk took in and paid out.
type Conversion struct {
	Sell   string `json:"sell"`
	Buy    string `json:"buy"`
	Sold   int64  `json:"sold"`
	Bought int64  `json:"bought"`
}

// FXResult is the fx step's result: the child's results by step name.
type FXResult struct {
	Quote   Quote      `json:"quote"`
	Convert Conversion `json:"convert"`
}

// NewDefinitions returns the transfer and its FX child, with the given
// retry policy for every step and compensation (zero fields take the
// defaults). An engine given the transfer runs the child too.
func NewDefinitions(policy saga.RetryPolicy) (transfer, fx *saga.Definition, err error) {
	fx, err = saga.New(FXName,
		saga.Step{Name: StepQuote, Reaches: StateQuoted, Kind: saga.DatabaseStep,
			Forward: saga.Handle(quote), Compensate: saga.Handle(void), Retry: policy, CompensateRetry: policy},
		saga.Step{Name: StepConvert, Reaches: StateConverted, Kind: saga.DatabaseStep,
			Forward: saga.Handle(convert), Compensate: saga.Handle(reverse), Retry: policy, CompensateRetry: policy},
	)
	if err != nil {
		return nil, nil, err
	}
	fx = saga.WithInput(fx, FXInput.Validate)
	transfer, err = saga.New(DefinitionName,
		saga.Step{Name: StepDebit, Reaches: StateDebited, Kind: saga.DatabaseStep,
			Forward: saga.Handle(debit), Compensate: saga.Handle(refund), Retry: policy, CompensateRetry: policy},
		saga.Step{Name: StepFX, Reaches: StateConverted, Kind: saga.ChildStep, Child: fx,
			When:    saga.Condition{Reads: []string{StepDebit}, Func: acrossCurrencies},
			Forward: saga.Handle(fxInput), Retry: policy, CompensateRetry: policy},
		saga.Step{Name: StepCredit, Reaches: StateCredited, Kind: saga.DatabaseStep,
			Forward: saga.Handle(credit), Retry: policy},
	)
	if err != nil {
		return nil, nil, err
	}
	return saga.WithInput(transfer, Input.Validate), fx, nil
}

// Definition and FX are the transfer and its child with default retry
// policies.
var Definition, FX = func() (*saga.Definition, *saga.Definition) {
	t, fx, err := NewDefinitions(saga.RetryPolicy{})
	if err != nil {
		panic(err)
	}
	return t, fx
}()

// acrossCurrencies is the fx step's condition: the debit's result names
// two currencies. A result it cannot read runs the step, whose child
// refuses an input it cannot convert.
func acrossCurrencies(sc *saga.StepContext) bool {
	var d Debit
	if ok, err := sc.DecodeResult(StepDebit, &d); !ok || err != nil {
		return true
	}
	return d.Currency != d.ToCurrency
}

func debit(ctx context.Context, sc *saga.StepContext, in Input) (Debit, error) {
	var to string
	var frozen bool
	err := sc.Tx.QueryRow(ctx, accountOf, in.To).Scan(&to, &frozen)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Debit{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrDestinationUnavailable, in.To))
	case err != nil:
		return Debit{}, fmt.Errorf("read account %d: %w", in.To, err) // retried
	}
	var currency string
	err = sc.Tx.QueryRow(ctx, debitSQL, in.From, in.Amount, sc.Key, sc.SagaID).Scan(&currency)
	if errors.Is(err, pgx.ErrNoRows) {
		var frozen bool
		err := sc.Tx.QueryRow(ctx, accountOf, in.From).Scan(new(string), &frozen)
		switch {
		case errors.Is(err, pgx.ErrNoRows) || err == nil && frozen:
			return Debit{}, saga.Permanent(fmt.Errorf("%w: account %d", ErrSourceUnavailable, in.From))
		case err != nil:
			return Debit{}, fmt.Errorf("read account %d: %w", in.From, err)
		}
		return Debit{}, saga.Permanent(fmt.Errorf("%w: account %d cannot pay %d", ErrInsufficientFunds, in.From, in.Amount))
	}
	if err != nil {
		return Debit{}, fmt.Errorf("debit account %d: %w", in.From, err)
	}
	return Debit{Account: in.From, Amount: in.Amount, Currency: currency, ToCurrency: to}, nil
}

// refund pays back what the debit took, as its result recorded.
func refund(ctx context.Context, sc *saga.StepContext, _ Input) (Credit, error) {
	var d Debit
	if ok, err := sc.DecodeResult(StepDebit, &d); err != nil || !ok {
		return Credit{}, saga.Permanent(fmt.Errorf("refund: the debit's result is not readable (%v); refund by hand", err))
	}
	tag, err := sc.Tx.Exec(ctx, creditSQL, d.Account, d.Amount, sc.Key, sc.SagaID, d.Currency, "refund")
	if err != nil {
		return Credit{}, fmt.Errorf("refund account %d: %w", d.Account, err)
	}
	if tag.RowsAffected() == 0 {
		return Credit{}, saga.Permanent(fmt.Errorf("refund: account %d no longer exists", d.Account))
	}
	return Credit{Account: d.Account, Amount: d.Amount, Currency: d.Currency}, nil
}

// fxInput is the fx step's Forward: the child's input, from the debit.
func fxInput(_ context.Context, sc *saga.StepContext, _ Input) (FXInput, error) {
	var d Debit
	if ok, err := sc.DecodeResult(StepDebit, &d); err != nil || !ok {
		return FXInput{}, saga.Permanent(fmt.Errorf("fx: the debit's result is not readable (%v)", err))
	}
	return FXInput{Sell: d.Currency, Buy: d.ToCurrency, Amount: d.Amount}, nil
}

// credit pays the destination what the conversion bought, or what the
// debit took when both accounts hold one currency.
func credit(ctx context.Context, sc *saga.StepContext, in Input) (Credit, error) {
	var d Debit
	if ok, err := sc.DecodeResult(StepDebit, &d); err != nil || !ok {
		return Credit{}, saga.Permanent(fmt.Errorf("credit: the debit's result is not readable (%v)", err))
	}
	pay := Credit{Account: in.To, Amount: d.Amount, Currency: d.Currency}
	var fx FXResult
	if ok, err := sc.DecodeResult(StepFX, &fx); err != nil {
		return Credit{}, saga.Permanent(fmt.Errorf("credit: the conversion's result is not readable: %w", err))
	} else if ok {
		pay.Amount, pay.Currency = fx.Convert.Bought, fx.Convert.Buy
	}
	tag, err := sc.Tx.Exec(ctx, creditSQL, pay.Account, pay.Amount, sc.Key, sc.SagaID, pay.Currency, StepCredit)
	if err != nil {
		return Credit{}, fmt.Errorf("credit account %d: %w", in.To, err)
	}
	if tag.RowsAffected() == 0 {
		return Credit{}, saga.Permanent(fmt.Errorf("%w: account %d does not take %s", ErrDestinationUnavailable, in.To, pay.Currency))
	}
	return pay, nil
}

func quote(ctx context.Context, sc *saga.StepContext, in FXInput) (Quote, error) {
	q := Quote{Sell: in.Sell, Buy: in.Buy, Sold: in.Amount}
	err := sc.Tx.QueryRow(ctx, quoteSQL, sc.Key, in.Sell, in.Buy, in.Amount, sc.SagaID).Scan(&q.Micros, &q.Bought)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Quote{}, saga.Permanent(fmt.Errorf("%w: %s to %s", ErrNoRate, in.Sell, in.Buy))
	case err != nil:
		return Quote{}, fmt.Errorf("quote %s to %s: %w", in.Sell, in.Buy, err)
	case q.Bought <= 0:
		return Quote{}, saga.Permanent(fmt.Errorf("crossborder: %d %s buys nothing at %d millionths", in.Amount, in.Sell, q.Micros))
	}
	return q, nil
}

func void(ctx context.Context, sc *saga.StepContext, _ FXInput) (struct{}, error) {
	_, err := sc.Tx.Exec(ctx, voidSQL, sc.SagaID)
	return struct{}{}, err
}

// convert moves the quoted amounts through the desk.
func convert(ctx context.Context, sc *saga.StepContext, _ FXInput) (Conversion, error) {
	var q Quote
	if ok, err := sc.DecodeResult(StepQuote, &q); err != nil || !ok {
		return Conversion{}, saga.Permanent(fmt.Errorf("convert: the quote's result is not readable (%v)", err))
	}
	c := Conversion{Sell: q.Sell, Buy: q.Buy, Sold: q.Sold, Bought: q.Bought}
	if err := move(ctx, sc, c.Sell, c.Buy, c.Sold, c.Bought, StepConvert); err != nil {
		return Conversion{}, err
	}
	return c, nil
}

// reverse undoes the conversion: the desk pays back what it took and
// takes back what it paid.
func reverse(ctx context.Context, sc *saga.StepContext, _ FXInput) (Conversion, error) {
	var c Conversion
	if ok, err := sc.DecodeResult(StepConvert, &c); err != nil || !ok {
		return Conversion{}, saga.Permanent(fmt.Errorf("reverse: the conversion's result is not readable (%v); reverse by hand", err))
	}
	if err := move(ctx, sc, c.Buy, c.Sell, c.Bought, c.Sold, "reverse"); err != nil {
		return Conversion{}, err
	}
	return c, nil
}

// move takes in of currency into the desk and pays out of currency
// outOf, under the step's key.
func move(ctx context.Context, sc *saga.StepContext, into, outOf string, in, out int64, step string) error {
	if _, err := sc.Tx.Exec(ctx, lockDesk, into, outOf); err != nil {
		return fmt.Errorf("desk: %w", err)
	}
	err := sc.Tx.QueryRow(ctx, convertSQL, into, outOf, in, out, sc.Key, sc.SagaID, step).Scan(new(int))
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return saga.Permanent(fmt.Errorf("%w: %d %s", ErrDeskShort, out, outOf))
	case err != nil:
		return fmt.Errorf("desk: %w", err)
	}
	return nil
}
