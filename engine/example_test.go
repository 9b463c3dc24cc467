package engine_test

import (
	"context"
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/saga"
)

// An engine runs a two-step saga; the same key and input started again
// return the same saga.
func Example() {
	infra := exampleenv.New() // a migrated database and a JetStream server
	defer infra.Close()
	ctx := context.Background()

	type booking struct {
		Room   string `json:"room"`
		Nights int    `json:"nights"`
	}
	def := saga.WithInput[booking](saga.MustNew("booking",
		saga.Step{Name: "hold", Reaches: "held", Kind: saga.DatabaseStep,
			Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, b booking) (string, error) {
				return "held " + b.Room, nil // writes would go through sc.Tx
			})},
		saga.Step{Name: "confirm", Reaches: "confirmed", Kind: saga.DatabaseStep,
			Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, b booking) (int, error) {
				return b.Nights, nil
			})},
	), nil)

	e, err := engine.New(engine.Config{Pool: infra.Pool, NATS: infra.NATS, Definitions: []*saga.Definition{def}})
	if err != nil {
		panic(err)
	}
	if err := e.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = e.Stop(context.Background()) }()

	cl := e.Client()
	first, err := cl.Start(ctx, def, "booking-17", booking{Room: "12", Nights: 2})
	if err != nil {
		panic(err)
	}
	again, _ := cl.Start(ctx, def, "booking-17", []byte(`{"nights":2,"room":"12"}`))
	_, reused := cl.Start(ctx, def, "booking-17", booking{Room: "12", Nights: 3})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sg, err := cl.Wait(wctx, first.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(sg.State, string(sg.Results["confirm"]))
	fmt.Println("same saga:", again.ID == first.ID, again.Duplicate)
	fmt.Println(reused != nil)
	// Output:
	// confirmed 2
	// same saga: true true
	// true
}
