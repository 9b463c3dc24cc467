package steps_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// A step worker on its own, in a process apart from the engine's: it
// takes step commands from the deployment's stream and answers each
// outcome with a reply, which an engine's orchestrator applies.
func Example() {
	infra := exampleenv.New()
	defer infra.Close()
	ctx := context.Background()
	def := saga.MustNew("ping", saga.Step{Name: "ping", Reaches: "ponged", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return json.RawMessage(`"pong"`), nil
		}})

	w, err := steps.New(steps.Config{Pool: infra.Pool, NATS: infra.NATS, Definitions: []*saga.Definition{def}})
	if err != nil {
		panic(err)
	}
	if err := w.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = w.Stop(context.Background()) }()

	// An engine for the orchestrator and the relay; its own step workers
	// share the commands with w.
	e, err := engine.New(engine.Config{Pool: infra.Pool, NATS: infra.NATS, Definitions: []*saga.Definition{def}})
	if err != nil {
		panic(err)
	}
	if err := e.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = e.Stop(context.Background()) }()

	client, _ := engine.NewClient(engine.Config{Pool: infra.Pool, Definitions: []*saga.Definition{def}})
	res, err := client.Start(ctx, def, "ping-1", map[string]string{})
	if err != nil {
		panic(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	sg, err := client.Wait(wctx, res.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(sg.State, string(sg.Results["ping"]))
	// Output: ponged "pong"
}
