package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idemsaga/idemsaga/saga"
)

type order struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

type reservation struct {
	Hold string `json:"hold"`
}

func Example() {
	reserve := saga.Handle(func(ctx context.Context, sc *saga.StepContext, o order) (reservation, error) {
		// A database step writes through sc.Tx, with the step's inbox
		// record: sc.Tx.Exec(ctx, "update stock set ...").
		return reservation{Hold: "hold-" + o.ID}, nil
	})
	release := saga.Handle(func(ctx context.Context, sc *saga.StepContext, o order) (struct{}, error) {
		var r reservation
		if _, err := sc.DecodeResult("reserve", &r); err != nil {
			return struct{}{}, err
		}
		// Release r.Hold, keyed by sc.Key.
		return struct{}{}, nil
	})
	charge := saga.Handle(func(ctx context.Context, sc *saga.StepContext, o order) (string, error) {
		if o.Amount <= 0 {
			return "", saga.Permanent(fmt.Errorf("amount %d is not positive", o.Amount))
		}
		// An external step calls the other system with sc.Key as its
		// idempotency key; an error it returns leaves the outcome unknown
		// unless marked with saga.Permanent or saga.NotApplied.
		return fmt.Sprintf("charged %d", o.Amount), nil
	})

	def, err := saga.New("checkout",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: reserve, Compensate: release},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: charge,
			Retry: saga.RetryPolicy{MaxAttempts: 3, Timeout: 10 * time.Second}},
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	for i, s := range def.Steps() {
		fmt.Printf("%d %s (%s): %s -> %s, compensable %t, %d attempts\n",
			i, s.Name, s.Kind, def.StateBefore(i), s.Reaches, s.Compensate != nil, s.Retry.MaxAttempts)
	}
	fmt.Println("final state:", def.FinalState())

	// The engine runs the handlers; here one is called by hand.
	out, err := def.Step(0).Forward(context.Background(), &saga.StepContext{
		Step:  "reserve",
		Input: json.RawMessage(`{"id":"o-1","amount":25}`),
	})
	fmt.Println(string(out), err)

	// Output:
	// 0 reserve (database): init -> reserved, compensable true, 5 attempts
	// 1 charge (external): reserved -> charged, compensable false, 3 attempts
	// final state: charged
	// {"hold":"hold-o-1"} <nil>
}

func ExampleNew_invalid() {
	_, err := saga.New("checkout", saga.Step{Name: "charge", Reaches: saga.StateFailed, Kind: saga.ExternalStep})
	fmt.Println(errors.Is(err, saga.ErrInvalidDefinition))
	fmt.Println(err)

	// Output:
	// true
	// idemsaga: invalid saga definition "checkout": steps[0].Reaches: "failed" is a built-in state; pick another name
}

func ExamplePermanent() {
	declined := errors.New("card declined")
	err := fmt.Errorf("charge order o-1: %w", saga.Permanent(declined))

	fmt.Println(saga.IsPermanent(err))
	fmt.Println(errors.Is(err, declined))
	fmt.Println(saga.IsPermanent(errors.New("connection reset")))
	fmt.Println(saga.Permanent(nil) == nil)

	// Output:
	// true
	// true
	// false
	// true
}

func ExampleNotApplied() {
	// In an external step: the payment service answered 503, which it
	// documents as "nothing was charged".
	err := saga.NotApplied(errors.New("payment service: 503 Service Unavailable"))
	fmt.Println(saga.IsNotApplied(err), saga.IsPermanent(err))

	// Output:
	// true false
}

func ExampleRetryAfter() {
	err := saga.RetryAfter(errors.New("429 Too Many Requests"), 2*time.Second)
	d, ok := saga.RetryDelay(err)
	fmt.Println(d, ok, saga.IsPermanent(err))

	// Output:
	// 2s true false
}

func ExampleStepKey() {
	id := [16]byte{0x01, 0x90}
	fwd := saga.StepKey(id, "charge", saga.PhaseForward)
	fmt.Println(fwd == saga.StepKey(id, "charge", saga.PhaseForward))
	fmt.Println(fwd == saga.StepKey(id, "charge", saga.PhaseCompensate))
	fmt.Println(fwd.Version())
	fmt.Println(saga.MessageID(fwd, 2) == fwd.String()+"-2")

	// Output:
	// true
	// false
	// VERSION_5
	// true
}

func ExampleCanonicalInput() {
	a, _ := saga.CanonicalInput(json.RawMessage(`{"b": 2, "a": 12345678901234567890}`))
	b, _ := saga.CanonicalInput(map[string]any{"a": json.Number("12345678901234567890"), "b": 2})
	fmt.Println(string(a))
	fmt.Println(string(a) == string(b))

	// Output:
	// {"a":12345678901234567890,"b":2}
	// true
}

// ExampleWithVersion deploys a changed definition as version 2 beside
// version 1: sagas started on version 1 finish on its two steps, new ones
// run the three of version 2. Give the engine both.
func ExampleWithVersion() {
	step := func(name string, reaches saga.State) saga.Step {
		return saga.Step{Name: name, Reaches: reaches, Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}
	}
	v1 := saga.MustNew("transfer", step("debit", "debited"), step("credit", "credited"))
	v2 := saga.WithVersion(saga.MustNew("transfer", step("debit", "debited"), step("hold", "held"), step("credit", "credited")), 2)
	fmt.Println(v1.Ref(), v1.Len(), "steps")
	fmt.Println(v2.Ref(), v2.Len(), "steps")
	// Output:
	// transfer@1 2 steps
	// transfer@2 3 steps
}

// A conditional step: digital goods skip shipping. The condition is
// decided once, when the step before it succeeds, and recorded with the
// saga; a skipped step takes no effect and is never compensated.
func ExampleCondition() {
	type item struct {
		Digital bool `json:"digital"`
	}
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def := saga.MustNew("delivery",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: noop},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: noop,
			When: saga.Condition{Func: func(sc *saga.StepContext) bool {
				var in item
				return sc.DecodeInput(&in) != nil || !in.Digital
			}}},
	)
	for _, input := range []string{`{"digital":false}`, `{"digital":true}`} {
		runs, _ := def.Runs(1, [16]byte{}, json.RawMessage(input), nil)
		fmt.Println(input, "ships:", runs)
	}
	_, err := saga.New("delivery",
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: noop,
			When: saga.Condition{Reads: []string{"charge"}, Func: func(*saga.StepContext) bool { return true }}},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: noop},
	)
	fmt.Println(errors.Is(err, saga.ErrInvalidDefinition))
	// Output:
	// {"digital":false} ships: true
	// {"digital":true} ships: false
	// true
}
