package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

// exampleFlags are the examples' own global flags.
type exampleFlags struct {
	// The examples' step policy is part of their definitions, which every
	// process of a deployment must share (each checks its own against the
	// deployment's record at start).
	StepTimeout       time.Duration `name:"step-timeout" env:"IDEMSAGA_STEP_TIMEOUT" default:"30s" help:"Timeout of one attempt of a step of the examples (shared)."`
	MaxAttempts       int           `name:"max-attempts" env:"IDEMSAGA_MAX_ATTEMPTS" default:"5" help:"Attempts of a step of the examples, the first included (shared)."`
	UndoAttempts      int           `name:"compensate-attempts" env:"IDEMSAGA_COMPENSATE_ATTEMPTS" default:"0" help:"Attempts of a compensation of the order example, the first included; 0: as --max-attempts (shared)."`
	MaxBackoff        time.Duration `name:"max-backoff" env:"IDEMSAGA_MAX_BACKOFF" default:"30s" help:"Longest wait between two attempts of a step of the examples (shared)."`
	PaymentsURL       string        `name:"payments-url" env:"IDEMSAGA_PAYMENTS_URL" default:"http://127.0.0.1:9465" help:"Base URL of the payment service the order example charges (worker payments runs one)."`
	OrderVerify       bool          `name:"order-verify" env:"IDEMSAGA_ORDER_VERIFY" default:"true" negatable:"" help:"Give the order example's charge its Verify, which asks the payment service about the key after an unknown outcome (shared)."`
	ChargeWait        time.Duration `name:"charge-wait" env:"IDEMSAGA_CHARGE_WAIT" default:"10m" help:"How long an order waits for the payment service's confirmation of its charge before refunding it (shared)."`
	OrderRate         int           `name:"order-rate" env:"IDEMSAGA_ORDER_RATE" default:"0" help:"Calls per second the order example makes to the payment service at most, across every worker (a saga.Limit on the charge, its refund and its Verify; 0: none; shared)."`
	CrossborderEvents string        `name:"crossborder-events" env:"IDEMSAGA_CROSSBORDER_EVENTS" help:"A NATS subject whose messages start cross-border transfers, keyed by their Transfer-Key header (a JetStream stream must hold it; shared)."`
	Settlement        bool          `name:"settlement" env:"IDEMSAGA_SETTLEMENT" help:"Run the nightly settlement example too, a scheduled saga (every night at 02:00 UTC), which reports to --reports-url (shared)."`
	ReportsURL        string        `name:"reports-url" env:"IDEMSAGA_REPORTS_URL" default:"http://127.0.0.1:9470" help:"Base URL of the reporting service the settlement example reports to (with --settlement)."`
	// The chaos run's comparisons (shared, hidden).
	OrderNaive    bool `name:"order-naive" env:"IDEMSAGA_ORDER_NAIVE" hidden:"" help:"Charge and refund with Go's default client, 503 read as not charged (chaos --naive)."`
	OrderNoRefund bool `name:"order-no-refund" env:"IDEMSAGA_ORDER_NO_REFUND" hidden:"" help:"The charge has no compensation (chaos --no-refund)."`
	OrderExternal bool `name:"order-external" env:"IDEMSAGA_ORDER_EXTERNAL" hidden:"" help:"The charge is an external step, confirmed by its answer alone (chaos --external-charge)."`
}

var examples exampleFlags

// The chaos and crash harnesses arm failpoints in the worker processes
// they start; only this binary reads them.
func init() {
	if err := failpoint.FromEnv(); err != nil {
		fmt.Fprintf(os.Stderr, "worker: %v\n", err)
		os.Exit(2)
	}
}

var commands = []service.Command{
	{Name: "seed", Help: "Create the examples' accounts and products (after migrate), which reconcile checks money and stock against.", Cmd: &seedCmd{}},
	{Name: "transfer", Help: "Start a money transfer saga (the same key gives the same saga).", Cmd: &transferCmd{}},
	{Name: "order", Help: "Start an order saga: reserve stock, charge at the payment service, ship (the same key gives the same saga).", Cmd: &orderCmd{}},
	{Name: "payments", Help: "Run the order example's payment service, which confirms charges by callback to the worker's API, optionally misbehaving (lost answers, 500s, slow answers).", Cmd: &paymentsCmd{}},
	{Name: "demo", Help: "Run the transfer demo on embedded defaults: an in-process NATS server and a fresh demo database.", Cmd: &demoCmd{}},
	{Name: "chaos", Help: "Run transfers, orders or cross-border transfers across worker processes while killing, pausing and disconnecting them and restarting NATS; then reconcile.", Cmd: &chaosCmd{}},
	{Name: "bench", Help: "Measure transfer sagas per second, latency and cost per saga against the local PostgreSQL, with pgbench as the ceiling.", Cmd: &benchCmd{}},
}

// definitions returns the examples' sagas, transfer, order and the
// cross-border transfer (whose FX child the engine registers with it),
// and with --settlement the nightly settlement, with the configured
// policy.
func (x *exampleFlags) definitions() ([]*saga.Definition, error) {
	t, o, err := x.examples()
	if err != nil {
		return nil, err
	}
	cb, err := x.crossborder(x.policy())
	if err != nil {
		return nil, err
	}
	defs := []*saga.Definition{t, o, cb}
	if x.Settlement {
		s, err := settlement.NewDefinition(settlement.Config{ReportsURL: x.ReportsURL, Policy: x.policy()})
		if err != nil {
			return nil, err
		}
		defs = append(defs, s)
	}
	return defs, nil
}

// policy is the examples' step policy from the flags.
func (x *exampleFlags) policy() saga.RetryPolicy {
	return saga.RetryPolicy{Timeout: x.StepTimeout, MaxAttempts: x.MaxAttempts, MaxBackoff: x.MaxBackoff}
}

func (x *exampleFlags) examples() (transferDef, orderDef *saga.Definition, err error) {
	if x.StepTimeout <= 0 || x.MaxAttempts < 1 || x.MaxBackoff < saga.InitialBackoffDefault {
		return nil, nil, fmt.Errorf("--step-timeout must be positive, --max-attempts at least 1 and --max-backoff at least %s", saga.InitialBackoffDefault)
	}
	policy := x.policy()
	if transferDef, err = transfer.NewDefinition(policy); err != nil {
		return nil, nil, err
	}
	orderDef, err = order.NewDefinition(x.orderConfig(policy))
	return transferDef, orderDef, err
}

// orderConfig is the order example's configuration from the flags.
func (x *exampleFlags) orderConfig(policy saga.RetryPolicy) order.Config {
	cfg := order.Config{PaymentsURL: x.PaymentsURL, Policy: policy, ChargeWait: x.ChargeWait, WithoutVerify: !x.OrderVerify,
		Naive: x.OrderNaive, WithoutRefund: x.OrderNoRefund, WithoutCallback: x.OrderExternal}
	if x.UndoAttempts > 0 {
		cfg.CompensatePolicy = policy
		cfg.CompensatePolicy.MaxAttempts = x.UndoAttempts
	}
	if x.OrderRate > 0 {
		cfg.Limit = saga.Limit{Name: "payments", Rate: x.OrderRate}
	}
	return cfg
}

// globals are the runtime's flags and the examples', for the examples'
// commands.
type globals struct {
	*service.Flags
	*exampleFlags
}

func withExamples(f *service.Flags) *globals { return &globals{Flags: f, exampleFlags: &examples} }

// client returns a saga client configured like the workers, and the
// definition of the named example.
func (g *globals) client(pool *pgxpool.Pool, name string) (*engine.Client, *saga.Definition, error) {
	cl, err := g.Client(pool)
	if err != nil {
		return nil, nil, err
	}
	def, err := cl.Definition(context.Background(), name)
	return cl, def, err
}

// crossborderKeyHeader is the header whose value keys a cross-border
// transfer started by an event (--crossborder-events).
const crossborderKeyHeader = "Transfer-Key"

// crossborder is the cross-border transfer with policy, started by the
// messages of --crossborder-events when it is set.
func (x *exampleFlags) crossborder(policy saga.RetryPolicy) (*saga.Definition, error) {
	def, _, err := crossborder.NewDefinitions(policy)
	if err != nil || x.CrossborderEvents == "" {
		return def, err
	}
	return saga.WithEvents(def, saga.Events{Subject: x.CrossborderEvents, KeyHeader: crossborderKeyHeader}), nil
}
