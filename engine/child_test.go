package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// fxInput steers the cross-currency transfer and its FX child.
type fxInput struct {
	Amount     int  `json:"amount"`
	FailFX     bool `json:"fail_fx"`     // the child's convert refuses for good
	FailCredit bool `json:"fail_credit"` // the parent's credit refuses for good
}

// fxLedger counts the effects of each step and phase, by key.
type fxLedger struct {
	mu   sync.Mutex
	keys map[string]map[uuid.UUID]int
	// failUndo makes the child's quote compensation fail for good.
	failUndo atomic.Bool
}

func (l *fxLedger) add(at string, key uuid.UUID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		l.keys = map[string]map[uuid.UUID]int{}
	}
	if l.keys[at] == nil {
		l.keys[at] = map[uuid.UUID]int{}
	}
	l.keys[at][key]++
}

// count is how many keys at saw, and the most effects one key had.
func (l *fxLedger) count(at string) (keys, most int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.keys[at] {
		most = max(most, n)
	}
	return len(l.keys[at]), most
}

func (l *fxLedger) step(name string, fail func(fxInput) bool) saga.HandlerFunc {
	return func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in fxInput
		if err := sc.DecodeInput(&in); err != nil {
			return nil, saga.Permanent(err)
		}
		if fail != nil && fail(in) {
			return nil, saga.Permanent(fmt.Errorf("%s refused", name))
		}
		l.add(name+"/"+string(sc.Phase), sc.Key)
		return json.Marshal(map[string]any{"step": name, "amount": in.Amount})
	}
}

// fxDefs are the FX child (quote → convert → confirm, a callback step) and the cross-currency transfer that runs it
// between debit and credit. The child gets twice the parent's amount, so
// a test sees the parent's Forward built its input.
func fxDefs(t *testing.T, l *fxLedger, prefix string) (parent, child *saga.Definition) {
	t.Helper()
	policy := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Timeout: 5 * time.Second}
	quoteUndo := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if l.failUndo.Load() {
			return nil, saga.Permanent(errors.New("the quote desk is closed"))
		}
		return l.step("quote", nil)(ctx, sc)
	}
	confirm := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		return l.step("confirm", nil)(ctx, sc)
	}
	child, err := saga.New(prefix+"fx",
		saga.Step{Name: "quote", Reaches: "quoted", Kind: saga.ExternalStep, Forward: l.step("quote", nil), Compensate: quoteUndo, Retry: policy, CompensateRetry: policy},
		saga.Step{Name: "convert", Reaches: "converted", Kind: saga.ExternalStep, Forward: l.step("convert", func(in fxInput) bool { return in.FailFX }),
			Compensate: l.step("convert", nil), Retry: policy, CompensateRetry: policy},
		saga.Step{Name: "confirm", Reaches: "confirmed", Kind: saga.CallbackStep, Forward: confirm, Compensate: l.step("confirm", nil), Retry: policy, CompensateRetry: policy, Wait: time.Hour},
	)
	require.NoError(t, err)
	childInput := func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in fxInput
		if err := sc.DecodeInput(&in); err != nil {
			return nil, saga.Permanent(err)
		}
		in.Amount *= 2
		return json.Marshal(in)
	}
	parent, err = saga.New(prefix+"xfer",
		saga.Step{Name: "debit", Reaches: "debited", Kind: saga.ExternalStep, Forward: l.step("debit", nil), Compensate: l.step("debit", nil), Retry: policy, CompensateRetry: policy},
		saga.Step{Name: "fx", Reaches: "converted", Kind: saga.ChildStep, Child: child, Forward: childInput, Retry: policy, CompensateRetry: policy},
		saga.Step{Name: "credit", Reaches: "credited", Kind: saga.ExternalStep, Forward: l.step("credit", func(in fxInput) bool { return in.FailCredit }), Retry: policy},
	)
	require.NoError(t, err)
	return parent, child
}

// completeHeld answers the confirm callbacks of held children, until
// ctx ends.
func completeHeld(ctx context.Context, cl *engine.Client, ids <-chan uuid.UUID) {
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-ids:
			_, _ = cl.Complete(ctx, engine.Callback{Token: saga.CallbackToken(id, "confirm"), EventID: "ok-" + id.String(), Result: json.RawMessage(`{"confirmed":true}`)})
		}
	}
}

// childOf returns the one child of parent.
func childOf(t *testing.T, cl *engine.Client, parent uuid.UUID) *saga.Instance {
	t.Helper()
	sg, err := cl.Get(context.Background(), parent)
	require.NoError(t, err)
	require.Len(t, sg.Children, 1, "saga %s has one child", parent)
	ch, err := cl.Get(context.Background(), sg.Children[0].ID)
	require.NoError(t, err)
	require.NotNil(t, ch.Parent)
	require.Equal(t, parent, *ch.Parent)
	require.Equal(t, "fx", ch.ParentStep)
	return ch
}

// TestChildSaga runs a child step's every ending: the child completes
// (the step takes its results, the parent goes on), the child fails and
// compensates itself (the step fails without effect: the parent undoes
// only the step before), the parent fails after the child completed (the
// child is compensated whole, before the step before it), and the parent
// is cancelled while the child waits for a callback (the child is
// cancelled, then the parent compensates). Children are registered with
// their parent. Reconcile finds nothing.
func TestChildSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	l := &fxLedger{}
	parent, child := fxDefs(t, l, "")
	e := startEngine(t, pool, nc, testenv.Name("CHILD"), []*saga.Definition{parent})
	cl := e.Client()

	t.Run("completes", func(t *testing.T) {
		res, err := cl.Start(ctx, parent, "ok", fxInput{Amount: 10})
		require.NoError(t, err)
		// The child waits for its confirm callback.
		var ch *saga.Instance
		waitFor(t, 30*time.Second, "the child to wait for its callback", func() bool {
			sg, err := cl.Get(ctx, res.ID)
			if err != nil || len(sg.Children) == 0 {
				return false
			}
			ch, err = cl.Get(ctx, sg.Children[0].ID)
			return err == nil && ch.State == "converted"
		})
		_, err = cl.Complete(ctx, engine.Callback{Token: saga.CallbackToken(ch.ID, "confirm"), EventID: "c1", Result: json.RawMessage(`{"rate":1.1}`)})
		require.NoError(t, err)
		sg := waitState(t, cl, res.ID, "credited")
		ch = childOf(t, cl, res.ID)
		require.Equal(t, saga.State("confirmed"), ch.State)
		require.Equal(t, child.Name(), ch.Definition)
		var in fxInput
		require.NoError(t, json.Unmarshal(ch.Input, &in))
		require.Equal(t, 20, in.Amount, "the parent's Forward built the child's input")
		var results map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(sg.Results["fx"], &results), "the step's result is the child's results")
		require.JSONEq(t, `{"rate":1.1}`, string(results["confirm"]))
		require.JSONEq(t, `{"step":"convert","amount":20}`, string(results["convert"]))
	})

	t.Run("child fails", func(t *testing.T) {
		res, err := cl.Start(ctx, parent, "fxfails", fxInput{Amount: 10, FailFX: true})
		require.NoError(t, err)
		sg := waitState(t, cl, res.ID, saga.StateCompensated)
		require.Contains(t, sg.Error, "was compensated")
		ch := childOf(t, cl, res.ID)
		require.Equal(t, saga.StateCompensated, ch.State)
		require.Equal(t, saga.StepFailed, stepStatus(sg, "fx", saga.PhaseForward))
		require.Empty(t, stepStatus(sg, "fx", saga.PhaseCompensate), "a child that compensated itself is not compensated again")
		require.Equal(t, saga.StepSucceeded, stepStatus(sg, "debit", saga.PhaseCompensate))
	})

	t.Run("parent fails after", func(t *testing.T) {
		ids := make(chan uuid.UUID, 1)
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go completeHeld(cctx, cl, ids)
		res, err := cl.Start(ctx, parent, "creditfails", fxInput{Amount: 10, FailCredit: true})
		require.NoError(t, err)
		var chID uuid.UUID
		waitFor(t, 30*time.Second, "the child", func() bool {
			sg, err := cl.Get(ctx, res.ID)
			if err != nil || len(sg.Children) == 0 {
				return false
			}
			chID = sg.Children[0].ID
			return true
		})
		ids <- chID
		sg := waitState(t, cl, res.ID, saga.StateCompensated)
		ch := childOf(t, cl, res.ID)
		require.Equal(t, saga.StateCompensated, ch.State, "the completed child is compensated whole")
		for _, s := range ch.Steps {
			t.Logf("%s/%s %s attempt %d %s", s.Step, s.Phase, s.Status, s.Attempt, s.LastError)
		}
		for _, a := range ch.Attempts {
			t.Logf("attempt %s/%s %d %s %s", a.Step, a.Phase, a.Attempt, a.Outcome, a.Error)
		}
		for _, s := range []string{"quote", "convert", "confirm"} {
			require.Equal(t, saga.StepSucceeded, stepStatus(ch, s, saga.PhaseCompensate), s)
		}
		require.Equal(t, saga.StepSucceeded, stepStatus(sg, "fx", saga.PhaseCompensate))
		fxUndone, debitUndone := stepAt(sg, "fx", saga.PhaseCompensate), stepAt(sg, "debit", saga.PhaseCompensate)
		require.True(t, !debitUndone.CreatedAt.Before(fxUndone.UpdatedAt), "the step before the child is undone after the child was")
		require.Len(t, ch.Repairs, 1)
		require.Equal(t, "compensate", ch.Repairs[0].Operation)
	})

	t.Run("parent cancelled", func(t *testing.T) {
		res, err := cl.Start(ctx, parent, "cancelled", fxInput{Amount: 10})
		require.NoError(t, err)
		var chID uuid.UUID
		waitFor(t, 30*time.Second, "the child to wait for its callback", func() bool {
			sg, err := cl.Get(ctx, res.ID)
			if err != nil || len(sg.Children) == 0 {
				return false
			}
			chID = sg.Children[0].ID
			ch, err := cl.Get(ctx, chID)
			return err == nil && ch.State == "converted"
		})
		_, err = cl.Cancel(ctx, res.ID, engine.Repair{Reason: "customer withdrew"})
		require.NoError(t, err)
		waitState(t, cl, res.ID, saga.StateCompensated)
		ch := childOf(t, cl, res.ID)
		require.Equal(t, saga.StateCompensated, ch.State)
		require.Equal(t, "cancel", ch.Repairs[0].Operation)
		require.Contains(t, ch.Error, "parent saga")
	})

	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{parent, child}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
	for _, s := range []string{"debit/forward", "quote/forward", "convert/forward", "confirm/forward", "credit/forward"} {
		_, most := l.count(s)
		require.LessOrEqual(t, most, 1, "%s took effect once per key", s)
	}
}

func stepAt(sg *saga.Instance, step string, phase saga.Phase) saga.StepExecution {
	for _, s := range sg.Steps {
		if s.Step == step && s.Phase == phase {
			return s
		}
	}
	return saga.StepExecution{}
}

func stepStatus(sg *saga.Instance, step string, phase saga.Phase) saga.StepStatus {
	return stepAt(sg, step, phase).Status
}
