package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
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
	CallbackURL  string        `name:"callback-url" env:"IDEMSAGA_CALLBACK_URL" default:"http://127.0.0.1:9464" help:"Base URL of a worker's API (worker run --http-addr), where the service confirms each charge (POST /v1/callbacks/{token}). Empty: no confirmations."`
	CallbackAuth string        `name:"callback-token-file" env:"IDEMSAGA_CALLBACK_TOKEN_FILE" help:"File whose first line is the bearer token for --callback-url (one of the worker's --api-tokens-file)."`
	ConfirmEarly float64       `name:"confirm-early" help:"Fraction of charges confirmed before the charge is answered."`
	LoseConfirm  float64       `name:"lose-confirmation" help:"Fraction of confirmations lost on their way."`
	RateLimit    int           `name:"rate-limit" help:"Answer 429 (with a Retry-After) above this many requests per second, across every caller and route (0: no limit)."`
	LateCommit   time.Duration `name:"late-commit" help:"Commit a charge only after this long, for --late-commit-fraction of them; a refund of its key meanwhile makes it refused."`
	LateFraction float64       `name:"late-commit-fraction" help:"Fraction of charges committed after --late-commit."`
	DropReused   float64       `name:"drop-reused" help:"Fraction of charges on a reused connection that commit, then drop the connection unanswered; the next charge request under the key is answered 503."`
}

// callbackNotifier posts confirmations to a worker's callback API.
func callbackNotifier(base, tokenFile string) (payments.NotifyFunc, error) {
	var bearer string
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("payments: read --callback-token-file: %w", err)
		}
		bearer, _, _ = strings.Cut(strings.TrimSpace(string(b)), "\n")
		if bearer = strings.TrimSpace(bearer); bearer == "" {
			return nil, fmt.Errorf("payments: --callback-token-file %s is empty; put the worker's API token on its first line", tokenFile)
		}
	}
	base = strings.TrimRight(base, "/")
	client := &http.Client{Timeout: 5 * time.Second}
	return func(ctx context.Context, n payments.Notice) error {
		body, err := json.Marshal(map[string]any{"event_id": n.EventID, "result": n.Charge})
		if err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/callbacks/"+url.PathEscape(n.Token), bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		if bearer != "" {
			req.Header.Set("Authorization", "Bearer "+bearer)
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		answer, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("the worker answered %d: %s", resp.StatusCode, bytes.TrimSpace(answer))
		}
		return nil
	}, nil
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
	svc.SetFaults(payments.Faults{LoseResponse: p.LoseResponse, FailBefore: p.FailBefore, Busy: p.Busy, Slow: p.Slow, SlowP: p.SlowFraction, Refunds: true,
		ConfirmEarly: p.ConfirmEarly, LoseConfirmation: p.LoseConfirm,
		RateLimit: p.RateLimit, LateCommit: p.LateCommit, LateCommitP: p.LateFraction, DropReused: p.DropReused}, uint64(time.Now().UnixNano()))
	if p.CallbackURL != "" {
		notify, err := callbackNotifier(p.CallbackURL, p.CallbackAuth)
		if err != nil {
			return err
		}
		svc.SetNotifier(notify)
	}
	defer svc.Close()
	ln, err := net.Listen("tcp", p.Addr)
	if err != nil {
		return fmt.Errorf("payments: listen on %s: %w (choose another with --addr)", p.Addr, err)
	}
	srv := &http.Server{Handler: svc.Handler(), ReadHeaderTimeout: 5 * time.Second, ConnContext: svc.ConnContext}
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
	log.Info("payment service stopped", "requests", c.Requests, "charges", c.Charges, "refunds", c.Refunds, "lost_responses", c.LostResponses, "replays", c.Replays,
		"confirmations", c.Confirmed, "confirmation_failures", c.ConfirmFailures, "rate_limited", c.RateLimited,
		"late_charges", c.LateCharges, "late_refused", c.LateRefused, "dropped_reused", c.DroppedReused, "busy_after_drop", c.BusyAfterDrop)
	return nil
}
