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

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/examples/order/payments"
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
	Amount int64 `json:"amount"`
	// Address is where a physical order ships; a digital one needs none.
	Address string `json:"address,omitempty"`
	// Digital goods are delivered without shipping: the ship step is
	// skipped (saga.Condition).
	Digital bool `json:"digital,omitempty"`
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
	case in.Address == "" && !in.Digital:
		return errors.New("order: address is empty; a physical order needs one (or set digital)")
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
	GroupPrepare              = "prepare"
	StatePrepared  saga.State = "prepared"
	StateShipped   saga.State = "shipped"
	DefinitionName            = "order"
)

// Config configures the order saga.
type Config struct {
	// PaymentsURL is the payment service's base URL, such as
	// http://127.0.0.1:9465. Required.
	PaymentsURL string
	// Transport sends the calls (httpcall.Client.Transport). Defaults to
	// http.DefaultTransport; whatever it is, each attempt makes one
	// request, bounded by the attempt's context.
	Transport http.RoundTripper
	// Policy is every step's retry policy (zero fields take the
	// defaults).
	Policy saga.RetryPolicy
	// CompensatePolicy, if not zero, is the compensations' retry policy
	// instead of Policy.
	CompensatePolicy saga.RetryPolicy
	// WithoutVerify leaves out the charge's Verify (which asks the
	// payment service what the key did after an unknown outcome), to
	// compare the two: the chaos run's --no-verify.
	WithoutVerify bool
	// ChargeWait is how long an order waits for the payment service's
	// confirmation of its charge; past it the charge is refunded.
	// Defaults to ChargeWaitDefault.
	ChargeWait time.Duration
	// Limit, if not zero, bounds the calls to the payment service (the
	// charge, its refund and its Verify share it): its quota per account,
	// across every worker.
	Limit saga.Limit

	// The chaos run's comparisons; never set them otherwise.

	// WithoutRefund leaves out the charge's compensation (a payment
	// method without refunds): an order whose charge may have happened
	// then parks for a person, as a step without a compensation does.
	WithoutRefund bool
	// WithoutCallback makes the charge an external step: the service's
	// answer to the charge request is the charge, and no confirmation
	// is waited for.
	WithoutCallback bool
	// Naive charges and refunds as a handler written without
	// saga/httpcall does: Go's default client, which resends a request
	// with an Idempotency-Key on its own when a reused connection drops,
	// and a 503 taken as "nothing charged" (saga.NotApplied).
	Naive bool
}

// ChargeWaitDefault is Config.ChargeWait's default.
const ChargeWaitDefault = 10 * time.Minute

// NewDefinition returns the order saga; its input is an Input, decoded
// strictly and validated at every start.
func NewDefinition(cfg Config) (*saga.Definition, error) {
	if cfg.PaymentsURL == "" {
		return nil, errors.New("order: Config.PaymentsURL is required: the payment service's base URL")
	}
	if cfg.ChargeWait == 0 {
		cfg.ChargeWait = ChargeWaitDefault
	}
	if cfg.CompensatePolicy == (saga.RetryPolicy{}) {
		cfg.CompensatePolicy = cfg.Policy
	}
	p := &paymentAPI{base: strings.TrimRight(cfg.PaymentsURL, "/"), calls: &httpcall.Client{Transport: cfg.Transport}, confirmed: !cfg.WithoutCallback}
	charge, refund := saga.Handle(p.charge), saga.Handle(p.refund)
	if cfg.Naive {
		n := &naiveAPI{base: p.base, client: &http.Client{Transport: cfg.Transport}, confirmed: p.confirmed}
		charge, refund = saga.Handle(n.charge), saga.Handle(n.refund)
	}
	if cfg.WithoutRefund {
		refund = nil
	}
	var verify saga.HandlerFunc
	if !cfg.WithoutVerify {
		verify = saga.Handle(p.verify)
	}
	if !cfg.Limit.IsZero() && cfg.Limit.Name == "" {
		cfg.Limit.Name = "payments"
	}
	kind, wait := saga.CallbackStep, cfg.ChargeWait
	if cfg.WithoutCallback {
		kind, wait = saga.ExternalStep, 0
	}
	d, err := saga.New(DefinitionName,
		// The stock is reserved and the card charged at once: a group
		// whose state is reached when both succeeded. If either fails,
		// the other finishes its attempt and is undone.
		saga.Step{
			Name: StepReserve, Reaches: StatePrepared, Group: GroupPrepare, Kind: saga.DatabaseStep,
			Forward: saga.Handle(reserve), Compensate: saga.Handle(release),
			Retry: cfg.Policy, CompensateRetry: cfg.CompensatePolicy,
		},
		saga.Step{
			// The payment service answers the charge request at once, and
			// confirms it later by callback (Confirmation is the step's
			// result).
			Name: StepCharge, Reaches: StatePrepared, Group: GroupPrepare, Kind: kind, Wait: wait,
			Forward: charge, Compensate: refund, Verify: verify, Limit: cfg.Limit,
			Retry: cfg.Policy, CompensateRetry: cfg.CompensatePolicy,
		},
		saga.Step{
			// Digital goods skip shipping: decided once, when the charge
			// is recorded, and never compensated.
			Name: StepShip, Reaches: StateShipped, Kind: saga.DatabaseStep,
			Forward: saga.Handle(ship), Retry: cfg.Policy,
			When: saga.Condition{Func: physical},
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

// physical is ship's condition: an order of physical goods ships.
func physical(sc *saga.StepContext) bool {
	var in Input
	if err := sc.DecodeInput(&in); err != nil {
		return true // ship decides, and refuses what it cannot ship
	}
	return !in.Digital
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
	base  string
	calls *httpcall.Client
	// confirmed: the service confirms each charge by callback.
	confirmed bool
}

// callback is where the service confirms a charge: the step's token, or
// nowhere for a charge that is an external step.
func callback(sc *saga.StepContext, confirmed bool) string {
	if !confirmed {
		return ""
	}
	return sc.CallbackToken()
}

// The payment service's answers to a charge: 201 charged, 200 the key
// charged before, 402 declined, 409 the key voided by a refund that came
// first. Its 503 ("busy, nothing charged") is answered before the service
// looks at the key, as a proxy's 503 would be: it is about one request,
// not about the key (an earlier attempt may have charged), so it is
// unknown, and the next attempt asks again under the same key. A 500 may
// come after the charge committed: unknown too.
func (p *paymentAPI) charge(ctx context.Context, sc *saga.StepContext, in Input) (payments.Charge, error) {
	var c payments.Charge
	res, err := p.calls.Do(ctx, sc, httpcall.Call{
		Method: http.MethodPost, URL: p.base + "/charges",
		JSON:    payments.ChargeRequest{Order: sc.SagaID, Customer: in.Customer, Amount: in.Amount, Callback: callback(sc, p.confirmed)},
		Success: []int{http.StatusCreated, http.StatusOK},
		Refused: []int{http.StatusPaymentRequired, http.StatusConflict},
	})
	switch {
	case err != nil && saga.IsPermanent(err) && res != nil && res.Status == http.StatusPaymentRequired:
		return c, saga.Permanent(fmt.Errorf("%w: customer %s", ErrDeclined, in.Customer))
	case err != nil:
		return c, fmt.Errorf("charge order %s: %w", sc.SagaID, err)
	}
	return c, res.Decode(&c)
}

// verify asks the payment service what the charge's key did after an
// attempt whose outcome is unknown: a charge found is the step's success
// (no second charge request), none found makes the attempt not applied.
// A charge request still on its way could take effect after a "none";
// the next attempt's request under the same key is answered with it, and
// a step given up is refunded by its key only when some attempt stayed
// unknown (docs/concepts.md).
func (p *paymentAPI) verify(ctx context.Context, sc *saga.StepContext, in Input) (payments.Charge, error) {
	var c payments.Charge
	res, err := p.calls.Do(ctx, sc, httpcall.Call{
		Method: http.MethodGet, URL: p.base + "/charges/" + sc.Key.String(),
		Success: []int{http.StatusOK}, NotApplied: []int{http.StatusNotFound},
	})
	if err != nil {
		return c, fmt.Errorf("ask the payment service about charge %s: %w", sc.Key, err)
	}
	if err := res.Decode(&c); err != nil {
		return c, err
	}
	if c.State == "voided" {
		return c, saga.NotApplied(fmt.Errorf("the payment service voided key %s: nothing was charged", sc.Key))
	}
	return c, nil
}

// refund gives the charge back by its key, or voids the key if the charge
// never came, so that a late charge under it is refused: a compensation
// that closes the door. Its 503 and 500 are unknown, as the charge's are.
func (p *paymentAPI) refund(ctx context.Context, sc *saga.StepContext, in Input) (payments.Refund, error) {
	var r payments.Refund
	res, err := p.calls.Do(ctx, sc, httpcall.Call{
		Method: http.MethodPost, URL: p.base + "/refunds",
		JSON:    payments.RefundRequest{Charge: sc.ForwardKey, Order: sc.SagaID, Customer: in.Customer},
		Success: []int{http.StatusOK},
	})
	if err != nil {
		return r, fmt.Errorf("refund order %s: %w", sc.SagaID, err)
	}
	return r, res.Decode(&r)
}

// naiveAPI calls the payment service as a handler written without
// saga/httpcall does (Config.Naive), for the chaos run to compare: one
// attempt can be two requests, and a 503 about the second is read as an
// answer about the key.
type naiveAPI struct {
	base      string
	client    *http.Client
	confirmed bool
}

func (n *naiveAPI) post(ctx context.Context, sc *saga.StepContext, path string, body, out any) (int, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return 0, saga.Permanent(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.base+path, bytes.NewReader(b))
	if err != nil {
		return 0, saga.Permanent(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", sc.Key.String())
	resp, err := n.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return resp.StatusCode, err
	}
	switch resp.StatusCode {
	case http.StatusOK, http.StatusCreated:
		return resp.StatusCode, json.Unmarshal(raw, out)
	case http.StatusServiceUnavailable:
		// The pitfall: "busy, nothing charged" is about this request.
		return resp.StatusCode, saga.NotApplied(fmt.Errorf("%s answered 503: %s", path, raw))
	}
	return resp.StatusCode, fmt.Errorf("%s answered %d: %s", path, resp.StatusCode, raw)
}

func (n *naiveAPI) charge(ctx context.Context, sc *saga.StepContext, in Input) (payments.Charge, error) {
	var c payments.Charge
	status, err := n.post(ctx, sc, "/charges", payments.ChargeRequest{Order: sc.SagaID, Customer: in.Customer, Amount: in.Amount, Callback: callback(sc, n.confirmed)}, &c)
	switch status {
	case http.StatusPaymentRequired:
		return c, saga.Permanent(fmt.Errorf("%w: customer %s", ErrDeclined, in.Customer))
	case http.StatusConflict:
		return c, saga.Permanent(err)
	}
	return c, err
}

func (n *naiveAPI) refund(ctx context.Context, sc *saga.StepContext, in Input) (payments.Refund, error) {
	var r payments.Refund
	_, err := n.post(ctx, sc, "/refunds", payments.RefundRequest{Charge: sc.ForwardKey, Order: sc.SagaID, Customer: in.Customer}, &r)
	return r, err
}
