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
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/saga"
)

// groupInput steers the parallel order.
type groupInput struct {
	Decline bool `json:"decline"` // authorize refuses for good
	Fail    bool `json:"fail"`    // ship refuses for good
	Digital bool `json:"digital"` // pack is skipped
}

// groupOrder is open → {reserve (database), authorize (external), pack
// (external, conditional)} in group "prepare" → ship. With first set the
// group comes first.
func groupOrder(t *testing.T, name string, fx *effects, first bool, slowReserve chan struct{}) *saga.Definition {
	t.Helper()
	policy := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Timeout: 5 * time.Second}
	reserve := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if slowReserve != nil {
			<-slowReserve // runs until authorize has failed
		}
		return fx.handler("reserve", nil)(ctx, sc)
	}
	steps := []saga.Step{
		{Name: "reserve", Reaches: "prepared", Group: "prepare", Kind: saga.DatabaseStep, Forward: reserve, Compensate: fx.handler("reserve", nil), Retry: policy},
		{Name: "authorize", Reaches: "prepared", Group: "prepare", Kind: saga.ExternalStep, Forward: fx.handler("authorize", func(in orderInput) bool { return false }), Compensate: fx.handler("authorize", nil), Retry: policy},
		{Name: "pack", Reaches: "prepared", Group: "prepare", Kind: saga.ExternalStep, Forward: fx.handler("pack", nil), Compensate: fx.handler("pack", nil), Retry: policy},
		{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: fx.handler("ship", nil), Retry: policy},
	}
	decline := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	_ = decline
	steps[1].Forward = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in groupInput
		if err := sc.DecodeInput(&in); err != nil {
			return nil, saga.Permanent(err)
		}
		if in.Decline {
			if slowReserve != nil {
				defer close(slowReserve)
			}
			return nil, saga.Permanent(errors.New("card declined"))
		}
		return fx.handler("authorize", nil)(ctx, sc)
	}
	steps[3].Forward = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in groupInput
		if err := sc.DecodeInput(&in); err != nil {
			return nil, saga.Permanent(err)
		}
		if in.Fail {
			return nil, saga.Permanent(errors.New("undeliverable"))
		}
		return fx.handler("ship", nil)(ctx, sc)
	}
	if !first {
		steps = append([]saga.Step{{Name: "open", Reaches: "opened", Kind: saga.ExternalStep, Forward: fx.handler("open", nil), Compensate: fx.handler("open", nil), Retry: policy}}, steps...)
		steps[3].When = saga.Condition{Func: func(sc *saga.StepContext) bool {
			var in groupInput
			return sc.DecodeInput(&in) == nil && !in.Digital
		}}
	}
	def, err := saga.New(name, steps...)
	require.NoError(t, err)
	return def
}

// stepTimes reads when each step (step/phase) of saga id was created.
func stepTimes(t *testing.T, e *engine.Engine, id uuid.UUID) map[string]time.Time {
	t.Helper()
	sg, err := e.Client().Get(context.Background(), id)
	require.NoError(t, err)
	out := map[string]time.Time{}
	for _, s := range sg.Steps {
		out[s.Step+"/"+string(s.Phase)] = s.CreatedAt
	}
	return out
}

// TestParallelGroup runs a group's every ending: all branches succeed
// (the saga reaches the group's state once, then goes on), a step after
// the group fails (the group's branches are compensated at once, then the
// step before the group), a branch is refused while another still runs
// (that one finishes its attempt, then is compensated; the refused one is
// not), a conditional branch skipped, and a saga that starts with its
// group. Reconcile finds nothing.
func TestParallelGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("PAR")
	fx := &effects{}
	slow := make(chan struct{})
	def := groupOrder(t, "porder", fx, false, nil)
	slowDef := groupOrder(t, "pslow", fx, false, slow)
	firstDef := groupOrder(t, "pfirst", fx, true, nil)
	defs := []*saga.Definition{def, slowDef, firstDef}
	e := startEngine(t, pool, nc, stream, defs)
	cl := e.Client()
	run := func(d *saga.Definition, key string, in groupInput, want saga.State) *saga.Instance {
		t.Helper()
		res, err := cl.Start(ctx, d, key, in)
		require.NoError(t, err)
		waitState(t, cl, res.ID, want)
		sg, err := cl.Get(ctx, res.ID)
		require.NoError(t, err)
		return sg
	}

	sg := run(def, "all", groupInput{}, "shipped")
	for _, b := range []string{"reserve", "authorize", "pack", "ship"} {
		require.Contains(t, sg.Results, b)
	}
	groups := map[string]string{}
	for _, s := range sg.Steps {
		groups[s.Step] = s.Group
	}
	require.Equal(t, map[string]string{"open": "", "reserve": "prepare", "authorize": "prepare", "pack": "prepare", "ship": ""}, groups, "show names each branch's group")
	times := stepTimes(t, e, sg.ID)
	require.Equal(t, times["reserve/forward"], times["authorize/forward"], "the branches are dispatched by one move")
	require.Equal(t, times["reserve/forward"], times["pack/forward"])

	sg = run(def, "digital", groupInput{Digital: true}, "shipped")
	require.Equal(t, []string{"pack"}, sg.Skipped)

	sg = run(def, "undeliverable", groupInput{Fail: true}, saga.StateCompensated)
	times = stepTimes(t, e, sg.ID)
	require.Equal(t, times["reserve/compensate"], times["authorize/compensate"], "a group's branches are compensated at once")
	require.Equal(t, times["reserve/compensate"], times["pack/compensate"])
	require.True(t, times["open/compensate"].After(times["reserve/compensate"]), "the step before the group after the group")
	for _, s := range sg.Steps {
		if s.Phase == saga.PhaseCompensate {
			require.Equal(t, saga.StepSucceeded, s.Status, s.Step)
		}
	}

	sg = run(slowDef, "declined", groupInput{Decline: true}, saga.StateCompensated)
	statuses := map[string]saga.StepStatus{}
	for _, s := range sg.Steps {
		statuses[s.Step+"/"+string(s.Phase)] = s.Status
	}
	require.Equal(t, saga.StepSucceeded, statuses["reserve/forward"], "the running branch finished its attempt")
	require.Equal(t, saga.StepSucceeded, statuses["reserve/compensate"], "and was undone")
	require.Equal(t, saga.StepFailed, statuses["authorize/forward"])
	require.NotContains(t, statuses, "authorize/compensate", "a refusal took no effect")
	require.Equal(t, saga.StepSucceeded, statuses["open/compensate"])

	sg = run(firstDef, "first", groupInput{}, "shipped")
	times = stepTimes(t, e, sg.ID)
	require.Equal(t, times["reserve/forward"], times["authorize/forward"], "a saga that starts with a group starts every branch")
	sg = run(firstDef, "first-declined", groupInput{Decline: true}, saga.StateCompensated)
	require.Contains(t, sg.Error, "card declined")

	diffs, err := engine.Reconcile(ctx, pool, defs, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestParallelBranchesUnderRedelivery runs sagas with a group on three
// engines sharing a database and a stream, every command of one branch
// delivered twice and the workers of another dying after commit: every
// saga reaches the group's state once and goes on, each branch takes
// effect under one key per saga, and reconcile finds nothing.
func TestParallelBranchesUnderRedelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("PARDUP")
	fx := &effects{}
	def := groupOrder(t, "pdup", fx, false, nil)
	var engines []*engine.Engine
	var faults []*attempt.Faults
	for range 3 {
		f := &attempt.Faults{}
		f.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "authorize", Times: 1000})
		f.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "reserve", Times: 1000})
		f.Add(attempt.Fault{Kind: attempt.CrashAfterCommit, Step: "reserve", Times: 5})
		faults = append(faults, f)
		engines = append(engines, startEngineCtx(t, testhook.With(ctx, &testhook.Hooks{Faults: f}), pool, nc, stream, []*saga.Definition{def}))
	}
	const n = 40
	var wg sync.WaitGroup
	ids := make([]uuid.UUID, n)
	var failed atomic.Int64
	for i := range n {
		wg.Go(func() {
			in := groupInput{Fail: i%4 == 1}
			res, err := engines[i%3].Client().Start(ctx, def, fmt.Sprintf("p-%03d", i), in)
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
		want := saga.State("shipped")
		if i%4 == 1 {
			want = saga.StateCompensated
		}
		waitState(t, cl, id, want)
	}
	for _, b := range []string{"reserve", "authorize", "pack"} {
		require.Equal(t, n, fx.keysOf(b+"/forward"), "branch %s ran under one key per saga", b)
		require.Equal(t, n/4, fx.keysOf(b+"/compensate"), "and was undone for each failed saga")
	}
	fired := 0
	for _, f := range faults {
		fired += f.Fired(attempt.DeliverTwice)
	}
	require.Positive(t, fired)
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestParallelGroupParksAndRetries parks a saga whose branch may have
// taken effect and has no compensation, while the branch beside it
// succeeded; an operator's retry runs the parked branch again under its
// key, and the group completes with the other branch's recorded result.
func TestParallelGroupParksAndRetries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("PARPARK")
	fx := &effects{}
	var holds atomic.Int64
	hold := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if holds.Add(1) == 1 {
			return nil, errors.New("the answer was lost") // unknown: possibly done
		}
		return fx.handler("hold", nil)(ctx, sc)
	}
	once := saga.RetryPolicy{MaxAttempts: 1, Timeout: 5 * time.Second}
	def, err := saga.New("ppark",
		saga.Step{Name: "reserve", Reaches: "held", Group: "g", Kind: saga.ExternalStep, Forward: fx.handler("reserve", nil), Compensate: fx.handler("reserve", nil)},
		saga.Step{Name: "hold", Reaches: "held", Group: "g", Kind: saga.ExternalStep, Forward: hold, Retry: once},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep, Forward: fx.handler("ship", nil)},
	)
	require.NoError(t, err)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def})
	cl := e.Client()
	res, err := cl.Start(ctx, def, "park", map[string]any{})
	require.NoError(t, err)
	sg := waitState(t, cl, res.ID, saga.StateParked)
	require.Contains(t, sg.Error, `step "hold" may have taken effect`)
	require.Zero(t, fx.keysOf("reserve/compensate"), "a park undoes nothing")

	_, err = cl.Retry(ctx, res.ID, engine.Repair{Reason: "the other system says it never held", By: "ops"})
	require.NoError(t, err)
	sg = waitState(t, cl, res.ID, "shipped")
	require.Contains(t, sg.Results, "reserve", "the branch that succeeded before the park kept its result")
	require.Equal(t, 1, fx.keysOf("reserve/forward"))
	require.Equal(t, 1, fx.keysOf("hold/forward"))
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestStartsOfAGroupFirstSagaShareASmallPool starts many sagas that begin
// with a parallel group at once through a client whose pool has two
// connections: a start's transaction must never hold a connection while
// it waits for another.
func TestStartsOfAGroupFirstSagaShareASmallPool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	fx := &effects{}
	def := groupOrder(t, "psmall", fx, true, nil)
	cfg := pool.Config().Copy()
	cfg.MaxConns = 2
	small, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(small.Close)
	ecfg := engine.Config{Pool: small, Definitions: []*saga.Definition{def}, Stream: "SMALL", SubjectPrefix: "t.small", Logger: quietLogger()}
	require.NoError(t, engine.Deploy(ctx, ecfg))
	cl, err := engine.NewClient(ecfg)
	require.NoError(t, err)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for i := range 32 {
		wg.Go(func() {
			_, err := cl.Start(sctx, def, fmt.Sprintf("s-%02d", i), groupInput{})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	var branches int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.steps where step in ('reserve', 'authorize', 'pack')`).Scan(&branches))
	require.Equal(t, 3*32, branches, "every saga started every branch of its first group")
}

// TestSkipNamesItsBranch skips, as an operator, each of two branches
// that wait out a long backoff, the one whose retry was scheduled first
// first: a skip takes the branch it names, and the group completes with
// the operator's results.
func TestSkipNamesItsBranch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	second := make(chan struct{})
	wait := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if sc.Step == "b" {
			<-second // b fails after a
		}
		return nil, saga.RetryAfter(errors.New("busy"), time.Hour) // the other system asks to wait
	}
	def, err := saga.New("pskip",
		saga.Step{Name: "a", Reaches: "both", Group: "g", Kind: saga.ExternalStep, Forward: wait},
		saga.Step{Name: "b", Reaches: "both", Group: "g", Kind: saga.ExternalStep, Forward: wait},
	)
	require.NoError(t, err)
	e := startEngine(t, pool, nc, testenv.Name("PARSKIP"), []*saga.Definition{def})
	cl := e.Client()
	res, err := cl.Start(ctx, def, "skip", map[string]any{})
	require.NoError(t, err)
	retrying := func(step string) func() bool {
		return func() bool {
			sg, err := cl.Get(ctx, res.ID)
			require.NoError(t, err)
			for _, s := range sg.Steps {
				if s.Step == step && s.Status == saga.StepRetrying {
					return true
				}
			}
			return false
		}
	}
	require.Eventually(t, retrying("a"), 30*time.Second, 10*time.Millisecond)
	close(second)
	require.Eventually(t, retrying("b"), 30*time.Second, 10*time.Millisecond)
	for _, step := range []string{"a", "b"} {
		_, err = cl.Skip(ctx, res.ID, engine.SkipStep{Step: step, Result: json.RawMessage(`{"by":"hand"}`)}, engine.Repair{Reason: "done by hand", By: "ops"})
		require.NoError(t, err, "skip %s", step)
	}
	sg := waitState(t, cl, res.ID, "both")
	require.JSONEq(t, `{"by":"hand"}`, string(sg.Results["a"]))
	require.JSONEq(t, `{"by":"hand"}`, string(sg.Results["b"]))
}
