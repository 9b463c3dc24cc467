package engine_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/saga"
)

// A server issues a submit token for a form; the form's submit starts the
// saga with it as its key, and a double submit answers with the same saga.
func ExampleClient_IssueToken() {
	infra := exampleenv.New()
	defer infra.Close()
	ctx := context.Background()

	type order struct {
		Item string `json:"item"`
	}
	def := saga.WithInput[order](saga.MustNew("order",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep,
			Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, o order) (string, error) {
				return o.Item, nil
			})},
	), nil)
	cl, err := engine.NewClient(engine.Config{Pool: infra.Pool, Definitions: []*saga.Definition{def}})
	if err != nil {
		panic(err)
	}

	// Rendering the form: a token that lives 30 minutes.
	tok, err := cl.IssueToken(ctx, def, 30*time.Minute)
	if err != nil {
		panic(err)
	}
	fmt.Println(strings.HasPrefix(tok.Token, engine.SubmitTokenPrefix), len(tok.Token))

	// The submit, twice (a double click).
	first, err := cl.Start(ctx, def, tok.Token, order{Item: "lamp"})
	if err != nil {
		panic(err)
	}
	again, err := cl.Start(ctx, def, tok.Token, order{Item: "lamp"})
	if err != nil {
		panic(err)
	}
	fmt.Println("same saga:", again.ID == first.ID, again.Duplicate)

	// A token the server never issued starts nothing.
	_, err = cl.Start(ctx, def, "st_made-up", order{Item: "lamp"})
	fmt.Println(errors.Is(err, engine.ErrSubmitTokenInvalid))
	// Output:
	// true 46
	// same saga: true true
	// true
}
