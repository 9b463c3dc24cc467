package order

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered .sql files of the tables, in its
// migrations folder (for service.Migration and sagatest).
var Migrations fs.FS = migrationFiles

// Schema holds the example's tables.
const Schema = "orders"

// Migrate creates or updates the order tables.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	return migrations.Apply(ctx, conn, Schema, sub)
}

// CheckMigrated fails when the database lacks the order tables of this
// build, saying to apply the migrations.
func CheckMigrated(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	_, _, err = migrations.CheckApplied(ctx, conn, Schema, sub)
	return err
}

// Input is an order's saga input.
type Input struct {
	Customer string `json:"customer"`
	Product  int64  `json:"product"`
	Quantity int64  `json:"quantity"`
	// Amount is what the customer pays, in the smallest unit.
	Amount  int64  `json:"amount"`
	Address string `json:"address"`
}

// Validate rejects an order that can never succeed, before anything is
// written.
func (in Input) Validate() error {
	switch {
	case in.Customer == "":
		return errors.New("order: customer is empty")
	case in.Quantity <= 0:
		return fmt.Errorf("order: quantity must be positive, got %d", in.Quantity)
	case in.Amount <= 0:
		return fmt.Errorf("order: amount must be positive, got %d", in.Amount)
	case in.Address == "":
		return errors.New("order: address is empty")
	}
	return nil
}

// Errors an order can end with; they are permanent.
var (
	ErrOutOfStock    = errors.New("out of stock")
	ErrDeclined      = errors.New("card declined")
	ErrUndeliverable = errors.New("the address cannot be delivered to")
)

// Undeliverable is the address ship refuses.
const Undeliverable = "nowhere"

// Step and state names.
const (
	StepReserve               = "reserve"
	StepCharge                = "charge"
	StepShip                  = "ship"
	StateReserved  saga.State = "reserved"
	StateCharged   saga.State = "charged"
	StateShipped   saga.State = "shipped"
	DefinitionName            = "order"
)

// Config configures the order saga.
type Config struct {
	// PaymentsURL is the payment service's base URL, such as
	// http://127.0.0.1:9465. Required.
	PaymentsURL string
	// Client makes the calls. Defaults to http.DefaultClient: each
	// attempt's context bounds its call.
	Client *http.Client
	// Policy is every step's retry policy (zero fields take the
	// defaults).
	Policy saga.RetryPolicy
	// ChargeWait is how long an order waits for the payment service's
	// confirmation of its charge; past it the charge is refunded.
	// Defaults to ChargeWaitDefault.
	ChargeWait time.Duration
}

// ChargeWaitDefault is Config.ChargeWait's default.
const ChargeWaitDefault = 10 * time.Minute

// NewDefinition returns the order saga; its input is an Input, decoded
// strictly and validated at every start.
func NewDefinition(cfg Config) (*saga.Definition, error) {
	if cfg.PaymentsURL == "" {
		return nil, errors.New("order: Config.PaymentsURL is required: the payment service's base URL")
	}
	if cfg.Client == nil {
		cfg.Client = http.DefaultClient
	}
	if cfg.ChargeWait == 0 {
		cfg.ChargeWait = ChargeWaitDefault
	}
	p := &paymentAPI{base: strings.TrimRight(cfg.PaymentsURL, "/"), client: cfg.Client}
	d, err := saga.New(DefinitionName,
		saga.Step{
			Name: StepReserve, Reaches: StateReserved, Kind: saga.DatabaseStep,
			Forward: saga.Handle(reserve), Compensate: saga.Handle(release),
			Retry: cfg.Policy, CompensateRetry: cfg.Policy,
		},
		saga.Step{
			// The payment service answers the charge request at once, and
			// confirms it later by callback (Confirmation is the step's
			// result).
			Name: StepCharge, Reaches: StateCharged, Kind: saga.CallbackStep, Wait: cfg.ChargeWait,
			Forward: saga.Handle(p.charge), Compensate: saga.Handle(p.refund),
			Retry: cfg.Policy, CompensateRetry: cfg.Policy,
		},
		saga.Step{
			Name: StepShip, Reaches: StateShipped, Kind: saga.DatabaseStep,
			Forward: saga.Handle(ship), Retry: cfg.Policy,
		},
	)
	if err != nil {
		return nil, err
	}
	return saga.WithInput(d, Input.Validate), nil
}

// Reservation is reserve's result.
type Reservation struct {
	Product  int64 `json:"product"`
	Quantity int64 `json:"quantity"`
}

func reserve(ctx context.Context, sc *saga.StepContext, in Input) (Reservation, error) {
	if err := in.Validate(); err != nil {
		return Reservation{}, saga.Permanent(err)
	}
	tag, err := sc.Tx.Exec(ctx, `with p as (
  update orders.products set stock = stock - $2 where id = $1 and stock >= $2 returning id
)
insert into orders.reservations (saga_id, product_id, quantity) select $3, id, $2 from p`, in.Product, in.Quantity, sc.SagaID)
	if err != nil {
		return Reservation{}, fmt.Errorf("reserve %d of product %d: %w", in.Quantity, in.Product, err)
	}
	if tag.RowsAffected() == 0 {
		return Reservation{}, saga.Permanent(fmt.Errorf("%w: product %d, %d wanted", ErrOutOfStock, in.Product, in.Quantity))
	}
	return Reservation{Product: in.Product, Quantity: in.Quantity}, nil
}

func release(ctx context.Context, sc *saga.StepContext, _ Input) (Reservation, error) {
	var r Reservation
	err := sc.Tx.QueryRow(ctx, `with r as (
  delete from orders.reservations where saga_id = $1 returning product_id, quantity
), p as (
  update orders.products p set stock = p.stock + r.quantity from r where p.id = r.product_id returning p.id
)
select product_id, quantity from r`, sc.SagaID).Scan(&r.Product, &r.Quantity)
	if errors.Is(err, pgx.ErrNoRows) {
		return Reservation{}, nil // nothing was reserved
	}
	if err != nil {
		return Reservation{}, fmt.Errorf("release the reservation of order %s: %w", sc.SagaID, err)
	}
	return r, nil
}

// Shipment is ship's result.
type Shipment struct {
	Address string `json:"address"`
}

func ship(ctx context.Context, sc *saga.StepContext, in Input) (Shipment, error) {
	if in.Address == Undeliverable {
		return Shipment{}, saga.Permanent(fmt.Errorf("%w: %q", ErrUndeliverable, in.Address))
	}
	if _, err := sc.Tx.Exec(ctx, `insert into orders.shipments (saga_id, address) values ($1, $2)`, sc.SagaID, in.Address); err != nil {
		return Shipment{}, fmt.Errorf("ship order %s: %w", sc.SagaID, err)
	}
	return Shipment{Address: in.Address}, nil
}

// paymentAPI calls the payment service.
type paymentAPI struct {
	base   string
	client *http.Client
}

func (p *paymentAPI) charge(ctx context.Context, sc *saga.StepContext, in Input) (payments.Charge, error) {
	var c payments.Charge
	status, err := p.post(ctx, "/charges", sc.Key, payments.ChargeRequest{Order: sc.SagaID, Customer: in.Customer, Amount: in.Amount, Callback: sc.CallbackToken()}, &c)
	switch {
	case err != nil:
		// A transport error or the attempt's timeout: the charge may
		// have gone through. The step is retried under the same key,
		// which the service answers with what it did.
		return c, fmt.Errorf("charge order %s: %w", sc.SagaID, err)
	case status == http.StatusCreated || status == http.StatusOK:
		return c, nil
	case status == http.StatusPaymentRequired:
		return c, saga.Permanent(fmt.Errorf("%w: customer %s", ErrDeclined, in.Customer))
	case status == http.StatusConflict:
		return c, saga.Permanent(errors.New("the payment service voided this charge: it was refunded before it arrived"))
	case status == http.StatusServiceUnavailable:
		// The service documents 503 as "nothing was charged".
		return c, saga.NotApplied(fmt.Errorf("charge order %s: the payment service is busy", sc.SagaID))
	default:
		// A 500 may come after the charge committed: unknown.
		return c, fmt.Errorf("charge order %s: the payment service answered %d", sc.SagaID, status)
	}
}

func (p *paymentAPI) refund(ctx context.Context, sc *saga.StepContext, in Input) (payments.Refund, error) {
	var r payments.Refund
	status, err := p.post(ctx, "/refunds", sc.Key, payments.RefundRequest{Charge: sc.ForwardKey, Order: sc.SagaID, Customer: in.Customer}, &r)
	switch {
	case err != nil:
		return r, fmt.Errorf("refund order %s: %w", sc.SagaID, err)
	case status == http.StatusOK:
		return r, nil
	case status == http.StatusServiceUnavailable:
		return r, saga.NotApplied(fmt.Errorf("refund order %s: the payment service is busy", sc.SagaID))
	default:
		return r, fmt.Errorf("refund order %s: the payment service answered %d", sc.SagaID, status)
	}
}

// post sends body as JSON under the idempotency key and decodes a 2xx
// answer into out. An error means no answer was read.
func (p *paymentAPI) post(ctx context.Context, path string, key uuid.UUID, body, out any) (int, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.base+path, bytes.NewReader(b))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key.String())
	resp, err := p.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(data, out); err != nil {
			return 0, fmt.Errorf("read the payment service's answer: %w", err)
		}
	}
	return resp.StatusCode, nil
}
