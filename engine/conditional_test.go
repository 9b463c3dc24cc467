package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/saga"
)

// orderInput is the conditional order's input.
type orderInput struct {
	Digital bool `json:"digital"`
	Gift    bool `json:"gift"`
	Decline bool `json:"decline"`
}

// effects counts each step's calls and the keys each phase saw.
type effects struct {
	mu   sync.Mutex
	keys map[string]map[uuid.UUID]int
}

func (e *effects) handler(name string, fail func(orderInput) bool) saga.HandlerFunc {
	return func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in orderInput
		if err := sc.DecodeInput(&in); err != nil {
			return nil, saga.Permanent(err)
		}
		if fail != nil && fail(in) {
			return nil, saga.Permanent(fmt.Errorf("%s refused", name))
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.keys == nil {
			e.keys = map[string]map[uuid.UUID]int{}
		}
		at := name + "/" + string(sc.Phase)
		if e.keys[at] == nil {
			e.keys[at] = map[uuid.UUID]int{}
		}
		e.keys[at][sc.Key]++
		return json.RawMessage(`{"ok":true}`), nil
	}
}

// keysOf is how many keys phase at of a step saw.
func (e *effects) keysOf(at string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.keys[at])
}

// conditionalOrder is reserve → pack (physical goods) → ship (physical
// goods) → charge → gift (when asked), with shipAsked deciding ship
// (nil: from the input).
func conditionalOrder(t *testing.T, fx *effects, shipAsked func(*saga.StepContext) bool) *saga.Definition {
	t.Helper()
	physical := func(sc *saga.StepContext) bool {
		var in orderInput
		return sc.DecodeInput(&in) == nil && !in.Digital
	}
	if shipAsked == nil {
		shipAsked = physical
	}
	policy := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Timeout: 2 * time.Second}
	def, err := saga.New("corder",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.ExternalStep, Forward: fx.handler("reserve", nil), Compensate: fx.handler("reserve", nil), Retry: policy},
		saga.Step{Name: "pack", Reaches: "packed", Kind: saga.ExternalStep, Forward: fx.handler("pack", nil), Compensate: fx.handler("pack", nil), Retry: policy,
			When: saga.Condition{Func: physical}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: fx.handler("ship", nil), Compensate: fx.handler("ship", nil), Retry: policy,
			When: saga.Condition{Reads: []string{"pack"}, Func: shipAsked}},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: fx.handler("charge", func(in orderInput) bool { return in.Decline }), Retry: policy},
		saga.Step{Name: "gift", Reaches: "gifted", Kind: saga.ExternalStep, Forward: fx.handler("gift", nil), Retry: policy,
			When: saga.Condition{Func: func(sc *saga.StepContext) bool {
				var in orderInput
				return sc.DecodeInput(&in) == nil && in.Gift
			}}},
	)
	require.NoError(t, err)
	return def
}

// TestConditionalSteps runs every shape of decision: all steps run,
// steps in the middle skipped, the last one skipped (the saga still ends
// in its final state), and a failure after skipped steps (they are not
// compensated). Show lists the skipped steps; reconcile finds nothing.
func TestConditionalSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("COND")
	fx := &effects{}
	def := conditionalOrder(t, fx, nil)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def})
	cl := e.Client()

	run := func(key string, in orderInput, want saga.State) *saga.Instance {
		t.Helper()
		res, err := cl.Start(ctx, def, key, in)
		require.NoError(t, err)
		waitState(t, cl, res.ID, want)
		sg, err := cl.Get(ctx, res.ID)
		require.NoError(t, err)
		return sg
	}
	statuses := func(sg *saga.Instance) []string {
		var out []string
		for _, s := range sg.Steps {
			out = append(out, s.Step+"/"+string(s.Phase)+":"+string(s.Status))
		}
		return out
	}

	sg := run("physical-gift", orderInput{Gift: true}, "gifted")
	require.Empty(t, sg.Skipped)
	require.Equal(t, []string{"reserve/forward:succeeded", "pack/forward:succeeded", "ship/forward:succeeded", "charge/forward:succeeded", "gift/forward:succeeded"}, statuses(sg))

	sg = run("digital", orderInput{Digital: true}, "gifted")
	require.Equal(t, []string{"pack", "ship", "gift"}, sg.Skipped, "decided once each, in order")
	require.Equal(t, []string{"reserve/forward:succeeded", "pack/forward:skipped", "ship/forward:skipped", "charge/forward:succeeded", "gift/forward:skipped"}, statuses(sg))
	require.NotContains(t, sg.Results, "pack")
	require.NotContains(t, sg.Results, "ship")

	sg = run("digital-declined", orderInput{Digital: true, Decline: true}, saga.StateCompensated)
	require.Equal(t, []string{"pack", "ship"}, sg.Skipped)
	require.Equal(t, []string{"reserve/forward:succeeded", "pack/forward:skipped", "ship/forward:skipped", "charge/forward:failed", "reserve/compensate:succeeded"}, statuses(sg))

	sg = run("physical-declined", orderInput{Decline: true}, saga.StateCompensated)
	require.Empty(t, sg.Skipped)
	require.Equal(t, 1, fx.keysOf("ship/compensate"), "the physical order's shipment is undone")
	require.Equal(t, 1, fx.keysOf("pack/compensate"))
	require.Equal(t, 2, fx.keysOf("reserve/compensate"))
	require.Equal(t, 2, fx.keysOf("ship/forward"), "ship ran for the physical orders only")
	require.Equal(t, 1, fx.keysOf("gift/forward"))

	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestConditionDecidedOnceUnderRedelivery runs sagas on three engines
// sharing one database and stream, with every command of the step before
// the conditions delivered twice and its workers dying after commit, and
// a condition that answers differently each time it is asked. Whatever
// the deliveries, each saga records one decision: a skipped step has no
// row and no effect, a step that ran is not skipped, and reconcile finds
// nothing.
func TestConditionDecidedOnceUnderRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("CONDDUP")
	fx := &effects{}
	var asked atomic.Int64
	// A condition that flips: two evaluations of one saga disagree.
	def := conditionalOrder(t, fx, func(*saga.StepContext) bool { return asked.Add(1)%2 == 0 })
	var engines []*engine.Engine
	var faults []*attempt.Faults
	for range 3 {
		f := &attempt.Faults{}
		f.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "pack", Times: 1000})
		f.Add(attempt.Fault{Kind: attempt.CrashAfterCommit, Step: "pack", Times: 5})
		faults = append(faults, f)
		// A worker that died after its commit leaves its command to a
		// lease: a short one keeps the test quick.
		engines = append(engines, startEngineCtx(t, testhook.With(ctx, &testhook.Hooks{Faults: f}), pool, nc, stream, []*saga.Definition{def},
			func(c *engine.Config) { c.LeaseGrace = time.Second }))
	}
	const n = 60
	var wg sync.WaitGroup
	ids := make([]uuid.UUID, n)
	for i := range n {
		wg.Go(func() {
			res, err := engines[i%3].Client().Start(ctx, def, fmt.Sprintf("o-%03d", i), orderInput{})
			require.NoError(t, err)
			ids[i] = res.ID
		})
	}
	wg.Wait()
	cl := engines[0].Client()
	ran := 0
	for _, id := range ids {
		waitState(t, cl, id, "gifted")
		sg, err := cl.Get(ctx, id)
		require.NoError(t, err)
		shipRows := 0
		for _, s := range sg.Steps {
			if s.Step == "ship" && s.Status != saga.StepSkipped {
				shipRows++
			}
		}
		switch len(sg.Skipped) {
		case 1:
			require.Equal(t, []string{"gift"}, sg.Skipped)
			require.Equal(t, 1, shipRows, "ship ran: it has its row")
			ran++
		default:
			require.Equal(t, []string{"ship", "gift"}, sg.Skipped, "one decision, recorded once")
			require.Zero(t, shipRows)
		}
	}
	require.Positive(t, ran, "the flipping condition ran ship for some sagas")
	require.Less(t, ran, n, "and skipped it for others")
	require.Equal(t, ran, fx.keysOf("ship/forward"), "a skipped ship never ran; one that ran ran under one key")
	fired := 0
	for _, f := range faults {
		fired += f.Fired(attempt.DeliverTwice)
	}
	require.Positive(t, fired, "the commands were delivered twice")
	require.Greater(t, asked.Load(), int64(0))
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestRepairsKeepRecordedDecisions parks a saga after one of its steps
// was skipped, then skips the parked step as an operator would: the
// recorded decision is not asked again, and the condition after the
// parked step is decided once, from the operator's result. A client
// without the definition's code refuses the repair that would have to
// decide, and changes nothing.
func TestRepairsKeepRecordedDecisions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("CONDREP")
	var askedPack, askedNotify atomic.Int64
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }
	lost := func(context.Context, *saga.StepContext) (json.RawMessage, error) {
		return nil, fmt.Errorf("the payment service did not answer") // unknown outcome
	}
	def, err := saga.New("condrepair",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.ExternalStep, Forward: noop, Compensate: noop},
		saga.Step{Name: "pack", Reaches: "packed", Kind: saga.ExternalStep, Forward: noop,
			When: saga.Condition{Func: func(*saga.StepContext) bool { askedPack.Add(1); return false }}},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Forward: lost,
			Retry: saga.RetryPolicy{MaxAttempts: 1, Timeout: 5 * time.Second}},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: noop,
			When: saga.Condition{Reads: []string{"charge"}, Func: func(sc *saga.StepContext) bool {
				askedNotify.Add(1)
				var r struct {
					Notify bool `json:"notify"`
				}
				ok, err := sc.DecodeResult("charge", &r)
				return ok && err == nil && r.Notify
			}}},
	)
	require.NoError(t, err)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def})
	cl := e.Client()
	res, err := cl.Start(ctx, def, "r-1", map[string]any{})
	require.NoError(t, err)
	sg := waitState(t, cl, res.ID, saga.StateParked)
	require.Equal(t, []string{"pack"}, sg.Skipped)
	require.Equal(t, int64(1), askedPack.Load())

	// A client built from the recorded description cannot decide
	// notify's condition: the skip is refused, nothing changes.
	admin, err := engine.NewClient(engine.Config{Pool: pool, Stream: stream, SubjectPrefix: "t." + stream, LeaseGrace: 10 * time.Second, Logger: quietLogger()})
	require.NoError(t, err)
	_, err = admin.Skip(ctx, res.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"notify":true}`)}, engine.Repair{Reason: "charged, checked by hand", By: "ops"})
	require.ErrorIs(t, err, saga.ErrConditionElsewhere)
	sg, err = cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateParked, sg.State)
	require.Empty(t, sg.Repairs)

	_, err = cl.Skip(ctx, res.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"notify":false}`)}, engine.Repair{Reason: "charged, checked by hand", By: "ops"})
	require.NoError(t, err)
	sg = waitState(t, cl, res.ID, "notified")
	require.Equal(t, []string{"pack", "notify"}, sg.Skipped)
	require.Equal(t, int64(1), askedPack.Load(), "the repair did not ask the recorded decision again")
	require.Equal(t, int64(1), askedNotify.Load())
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Len(t, diffs, 0)
}
