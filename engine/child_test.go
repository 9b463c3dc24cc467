package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/testhook"
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
	return fxDefsWith(t, l, prefix, true, 5*time.Second)
}

// fxDefsWith is fxDefs; without callback the child's confirm is an
// external step; timeout is every step's.
func fxDefsWith(t *testing.T, l *fxLedger, prefix string, callback bool, timeout time.Duration) (parent, child *saga.Definition) {
	t.Helper()
	policy := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Timeout: timeout}
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
		confirmStep(callback, confirm, l.step("confirm", nil), policy),
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

func confirmStep(callback bool, forward, undo saga.HandlerFunc, policy saga.RetryPolicy) saga.Step {
	s := saga.Step{Name: "confirm", Reaches: "confirmed", Kind: saga.ExternalStep, Forward: forward, Compensate: undo, Retry: policy, CompensateRetry: policy}
	if callback {
		s.Kind, s.Wait = saga.CallbackStep, time.Hour
	}
	return s
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

	defs := []*saga.Definition{parent, child}
	diffs, err := engine.Reconcile(ctx, pool, defs, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
	for _, s := range []string{"debit/forward", "quote/forward", "convert/forward", "confirm/forward", "credit/forward"} {
		_, most := l.count(s)
		require.LessOrEqual(t, most, 1, "%s took effect once per key", s)
	}

	// Reconcile's rules of children and ticks, each on a planted fault.
	plant := func(sql string, args ...any) {
		t.Helper()
		tag, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
		require.Positive(t, tag.RowsAffected(), sql)
	}
	byKey := func(key string) uuid.UUID {
		var id uuid.UUID
		require.NoError(t, pool.QueryRow(ctx, `select id from idemsaga.sagas where definition = $1 and idem_key = $2`, parent.Name(), key).Scan(&id))
		return id
	}
	// The cancelled parent's child is put back to a state short of
	// compensated.
	plant(`update idemsaga.sagas set state = 'converted' where parent_id = $1`, byKey("cancelled"))
	// The completed parent's child step waits again, for a child that
	// ended an hour ago.
	ok := byKey("ok")
	plant(`update idemsaga.steps set status = 'waiting' where saga_id = $1 and step = 'fx' and phase = 'forward'`, ok)
	plant(`update idemsaga.sagas set finished_at = now() - interval '1 hour' where parent_id = $1`, ok)
	// A second child under the same step: the child of the parent that
	// failed after its child completed moves there.
	plant(`update idemsaga.sagas set parent_id = $1 where parent_id = $2`, ok, byKey("creditfails"))
	// Two sagas of one tick, written in two time zones.
	plant(`update idemsaga.sagas set idem_key = 'tick:2026-12-01T00:00:00Z' where id = $1`, byKey("fxfails"))
	plant(`update idemsaga.sagas set idem_key = 'tick:2026-12-01T01:00:00+01:00' where id = $1`, byKey("cancelled"))

	diffs, err = engine.Reconcile(ctx, pool, defs, time.Minute)
	require.NoError(t, err)
	var all []string
	for _, d := range diffs {
		all = append(all, d.String())
	}
	text := strings.Join(all, "\n")
	require.Contains(t, text, "compensated, but a child of it was not")
	require.Contains(t, text, "a child step started several children: fx: ")
	require.Contains(t, text, "waits for a child that ended and was not told: fx/forward waits for child")
	require.Contains(t, text, "several sagas started for one tick of its schedule: "+parent.Name()+" tick:2026-12-01T00:00:00Z, tick:2026-12-01T01:00:00+01:00")
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

// childrenByParent counts the children of each parent.
func childrenByParent(t *testing.T, pool *pgxpool.Pool) map[uuid.UUID]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select parent_id, count(*) from idemsaga.sagas where parent_id is not null group by parent_id`)
	require.NoError(t, err)
	out := map[uuid.UUID]int{}
	for rows.Next() {
		var id uuid.UUID
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		out[id] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// TestChildStepUnderRedelivery: two engines share one database and
// stream and run 30 transfers, a third of whose children fail and a
// third of whose parents fail after their child completed. Every command
// of the child step is delivered twice, its workers die after commit, and
// its answers are lost; the engines drop the ends of the children they
// move, so only the reaper's sweep tells the parents. Each parent has one
// child, each child's steps took effect once per key, and each child of a
// failed parent was undone whole.
func TestChildStepUnderRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("CHILDDUP")
	l := &fxLedger{}
	parent, child := fxDefsWith(t, l, "", false, 2*time.Second)
	var engines []*engine.Engine
	var faults []*attempt.Faults
	for range 2 {
		f := &attempt.Faults{}
		f.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "fx", Times: 1000})
		f.Add(attempt.Fault{Kind: attempt.CrashAfterCommit, Step: "fx", Times: 4})
		f.Add(attempt.Fault{Kind: attempt.LoseOutcome, Step: "fx", Times: 4})
		f.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "convert", Times: 1000})
		faults = append(faults, f)
		// A worker that died after its commit leaves its command to a
		// lease: a short one keeps the test quick.
		engines = append(engines, startEngineCtx(t, testhook.With(ctx, &testhook.Hooks{Faults: f, LoseChildEnds: true}), pool, nc, stream, []*saga.Definition{parent},
			func(c *engine.Config) { c.LeaseGrace = time.Second }))
	}
	const n = 30
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := range n {
		wg.Go(func() {
			res, err := engines[i%2].Client().Start(ctx, parent, fmt.Sprintf("x-%03d", i), fxInput{Amount: i, FailFX: i%3 == 1, FailCredit: i%3 == 2})
			if err != nil {
				failed.Add(1)
				return
			}
			ids[i] = res.ID
		})
	}
	wg.Wait()
	require.Zero(t, failed.Load())
	cl := engines[0].Client()
	for i, id := range ids {
		want := saga.State("credited")
		if i%3 != 0 {
			want = saga.StateCompensated
		}
		waitState(t, cl, id, want)
		ch := childOf(t, cl, id)
		wantChild := saga.State("confirmed")
		if i%3 != 0 {
			wantChild = saga.StateCompensated
		}
		require.Equal(t, wantChild, ch.State, "child of saga %d", i)
	}
	byParent := childrenByParent(t, pool)
	require.Len(t, byParent, n)
	for id, k := range byParent {
		require.Equal(t, 1, k, "parent %s has one child", id)
	}
	for _, s := range []string{"quote/forward", "convert/forward", "confirm/forward", "quote/compensate"} {
		keys, most := l.count(s)
		require.Equal(t, 1, most, "%s took effect once per key", s)
		want := n
		switch s {
		case "convert/forward", "confirm/forward":
			want = n - n/3 // the failing convert refuses before its effect
		case "quote/compensate":
			want = 2 * n / 3
		}
		require.Equal(t, want, keys, s)
	}
	keys, _ := l.count("convert/compensate")
	require.Equal(t, n/3, keys, "each child of a parent that failed after it was undone whole")
	fired := map[attempt.FaultKind]int{}
	for _, f := range faults {
		for _, k := range []attempt.FaultKind{attempt.DeliverTwice, attempt.CrashAfterCommit, attempt.LoseOutcome} {
			fired[k] += f.Fired(k)
		}
	}
	require.Positive(t, fired[attempt.DeliverTwice])
	require.Positive(t, fired[attempt.CrashAfterCommit]+fired[attempt.LoseOutcome])
	t.Logf("faults fired: %v", fired)
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{parent, child}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestParentAndChildRepairedAtOnce: 12 parents fail after their child
// completed, and the child's compensation cannot finish, so the child
// ends failed and the parent too. Once the cause is fixed, half of them
// are repaired by a retry of the parent alone (which resumes its child's
// compensation), half by a retry of the parent and of the child at
// once. Every one ends compensated, parent and child, each undo took
// effect once per key, and reconcile finds nothing.
func TestParentAndChildRepairedAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	l := &fxLedger{}
	l.failUndo.Store(true)
	parent, child := fxDefsWith(t, l, "", false, 5*time.Second)
	e := startEngine(t, pool, nc, testenv.Name("CHILDREP"), []*saga.Definition{parent})
	cl := e.Client()
	const n = 12
	ids := make([]uuid.UUID, n)
	for i := range n {
		res, err := cl.Start(ctx, parent, fmt.Sprintf("r-%03d", i), fxInput{Amount: i, FailCredit: true})
		require.NoError(t, err)
		ids[i] = res.ID
	}
	children := make([]uuid.UUID, n)
	for i, id := range ids {
		sg := waitState(t, cl, id, saga.StateFailed)
		require.Contains(t, sg.Error, "could not finish its compensation")
		ch := childOf(t, cl, id)
		require.Equal(t, saga.StateFailed, ch.State)
		children[i] = ch.ID
	}
	l.failUndo.Store(false)
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for i := range n {
		wg.Go(func() {
			_, err := cl.Retry(ctx, ids[i], engine.Repair{Reason: "the quote desk is open again"})
			errs <- err
		})
		if i%2 == 1 {
			wg.Go(func() {
				_, err := cl.Retry(ctx, children[i], engine.Repair{Reason: "the quote desk is open again"})
				if errors.Is(err, engine.ErrStateForbids) {
					err = nil // the parent's retry resumed it first
				}
				errs <- err
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i, id := range ids {
		waitState(t, cl, id, saga.StateCompensated)
		ch := waitState(t, cl, children[i], saga.StateCompensated)
		require.Equal(t, saga.StateCompensated, ch.State)
	}
	keys, most := l.count("quote/compensate")
	require.Equal(t, n, keys)
	require.Equal(t, 1, most, "each undo took effect once per key")
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{parent, child}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}
