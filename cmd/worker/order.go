package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/service"
)

type orderCmd struct {
	Customer string        `required:"" help:"Customer to charge (a name starting with 'declined-' is declined)."`
	Product  int64         `required:"" help:"Product to reserve."`
	Quantity int64         `default:"1" help:"Units to reserve."`
	Amount   int64         `required:"" help:"Amount to charge, in the smallest unit."`
	Address  string        `required:"" help:"Where to ship ('nowhere' cannot be shipped to: the charge is refunded)."`
	Key      string        `required:"" help:"Idempotency key: the business identifier of this order. Resending the same key and input returns the same saga."`
	Wait     bool          `help:"Wait for the saga to finish and print its final state (needs a running worker and payment service)."`
	Timeout  time.Duration `default:"60s" help:"How long --wait waits."`
}

func (o *orderCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	in := order.Input{Customer: o.Customer, Product: o.Product, Quantity: o.Quantity, Amount: o.Amount, Address: o.Address}
	if err := in.Validate(); err != nil {
		return err
	}
	pool, err := openDB(ctx, g.DatabaseURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	return startAndWait(ctx, g, pool, order.DefinitionName, "an order", o.Key, in, o.Wait, o.Timeout)
}

type paymentsCmd struct {
	Addr         string        `default:"127.0.0.1:9465" help:"Address to listen on."`
	Products     int           `default:"0" help:"Seed this many products of --stock units each for the order example (0: leave the products as they are)."`
	Stock        int64         `default:"1000" help:"Units of each seeded product."`
	LoseResponse float64       `name:"lose-response" help:"Fraction of charges and refunds committed whose answer is lost."`
	FailBefore   float64       `name:"fail-before" help:"Fraction of requests answered 500 before anything is charged."`
	Busy         float64       `help:"Fraction of requests answered 503 (not charged, try again)."`
	Slow         time.Duration `help:"Answer a committed charge only after this long, for --slow-fraction of them."`
	SlowFraction float64       `name:"slow-fraction" help:"Fraction of charges answered after --slow."`
}

func (p *paymentsCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	log := newLogger(g.LogLevel, g.LogFormat)
	pool, err := openDB(ctx, g.DatabaseURL, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrateAll(ctx, pool); err != nil {
		return err
	}
	if p.Products > 0 {
		if err := order.Seed(ctx, pool, p.Products, p.Stock); err != nil {
			return err
		}
	}
	svc := payments.New(pool, log)
	svc.SetFaults(payments.Faults{LoseResponse: p.LoseResponse, FailBefore: p.FailBefore, Busy: p.Busy, Slow: p.Slow, SlowP: p.SlowFraction, Refunds: true}, uint64(time.Now().UnixNano()))
	ln, err := net.Listen("tcp", p.Addr)
	if err != nil {
		return fmt.Errorf("payments: listen on %s: %w (choose another with --addr)", p.Addr, err)
	}
	srv := &http.Server{Handler: svc.Handler(), ReadHeaderTimeout: 5 * time.Second}
	log.Info("payment service listening; SIGINT or SIGTERM stops it", "addr", ln.Addr().String(), "pid", os.Getpid())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	c := svc.Counts()
	log.Info("payment service stopped", "charges", c.Charges, "refunds", c.Refunds, "lost_responses", c.LostResponses, "replays", c.Replays)
	return nil
}
