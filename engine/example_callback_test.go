package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/saga"
)

// A payment channel takes the charge request at once and confirms it
// later by callback, twice; the step completes once.
func ExampleClient_Complete() {
	infra := exampleenv.New()
	defer infra.Close()
	ctx := context.Background()

	sent := make(chan string, 1)
	def := saga.MustNew("checkout",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.CallbackStep, Wait: time.Hour,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				// POST the charge with Idempotency-Key sc.Key and a callback
				// URL that carries sc.CallbackToken().
				sent <- sc.CallbackToken()
				return nil, nil
			}},
	)
	e, err := engine.New(engine.Config{Pool: infra.Pool, NATS: infra.NATS, Definitions: []*saga.Definition{def}})
	if err != nil {
		panic(err)
	}
	if err := e.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = e.Stop(context.Background()) }()
	cl := e.Client()
	res, err := cl.Start(ctx, def, "cart-9", map[string]int{"total": 4200})
	if err != nil {
		panic(err)
	}

	// The channel's webhook, delivered twice with its transaction number
	// (the first may come before the engine recorded that the request was
	// accepted: it is kept, and applied when the step waits).
	token := <-sent
	for range 2 {
		r, err := cl.Complete(ctx, engine.Callback{Token: token, EventID: "ch_7731", Result: json.RawMessage(`{"txn":"ch_7731"}`)})
		if err != nil {
			panic(err)
		}
		fmt.Println("replayed:", r.Replayed)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sg, err := cl.Wait(wctx, res.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(sg.State, string(sg.Results["charge"]))
	// Output:
	// replayed: false
	// replayed: true
	// charged {"txn": "ch_7731"}
}
