package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// TestCancelRunningSaga cancels a transfer whose deduction is done and
// whose credit is in flight: the credit is fenced, the deduction refunded.
// A credit that already took effect completes the saga instead.
func TestCancelRunningSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	stream := testenv.Name("CANCEL")
	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, LeaseGrace: time.Hour, Logger: quietLogger(),
		Stream: stream, SubjectPrefix: "t." + stream})
	require.NoError(t, err)
	w := newReplyWorker(t, pool, "x", 0, def)
	cl := e.Client()
	run := func(id saga.Instance, step string) wire.Reply {
		r, err := w.Handle(ctx, wire.Command{SagaID: id.ID, Definition: def.Name(), Step: step, Phase: saga.PhaseForward,
			Key: saga.StepKey(id.ID, step, saga.PhaseForward), Attempt: 1, Input: id.Input})
		require.NoError(t, err)
		return r
	}
	start := func(key string) saga.Instance {
		res, err := cl.Start(ctx, def, key, transferInput(1, 2, 10))
		require.NoError(t, err)
		sg, err := cl.Get(ctx, res.ID)
		require.NoError(t, err)
		v, err := e.ApplyReply(ctx, run(*sg, fixture.StepDeduct))
		require.NoError(t, err)
		require.Equal(t, engine.VerdictApplied, v)
		return *sg
	}

	pending := start("cancel-me")
	_, err = cl.Cancel(ctx, pending.ID, engine.Repair{Reason: "customer changed their mind"})
	require.NoError(t, err)
	_, err = cl.Cancel(ctx, pending.ID, engine.Repair{Reason: "again"})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	late := run(pending, fixture.StepCredit) // a late credit delivery
	require.True(t, late.Duplicate, "the credit's key was fenced by the cancel")

	ran := start("too-late")
	run(ran, fixture.StepCredit) // took effect; its reply never arrived
	_, err = cl.Cancel(ctx, ran.ID, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, "completed before it could be cancelled")

	startEngine(t, pool, nc, stream, []*saga.Definition{def})
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sg, err := cl.Wait(wctx, pending.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "customer changed their mind")
	sg, err = cl.Get(ctx, ran.ID)
	require.NoError(t, err)
	require.Equal(t, fixture.StateCredited, sg.State)
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}

// TestRetryFailedSaga: a compensation fails until a person repairs its
// cause; retry resumes it with the same key and the saga ends compensated,
// the compensation's effect happening once. The timeline shows it all.
func TestRetryFailedSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `create table effects (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	var repaired atomic.Bool
	quick := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond}
	def := saga.MustNew("repair",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Forward: recorder("a", nil), Retry: quick, CompensateRetry: quick,
			Compensate: recorder("a", func(int) error {
				if !repaired.Load() {
					return errors.New("refund service is down")
				}
				return nil
			})},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "b_done", Forward: recorder("b", func(int) error { return saga.Permanent(errors.New("declined")) }), Retry: quick},
	)
	e := startEngine(t, pool, nc, testenv.Name("RETRY"), []*saga.Definition{def})
	cl := e.Client()
	res, err := cl.Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sg, err := cl.Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateFailed, sg.State)

	failed, err := cl.List(ctx, engine.ListOptions{State: saga.StateFailed})
	require.NoError(t, err)
	require.Len(t, failed, 1)
	require.Equal(t, res.ID, failed[0].ID)

	repaired.Store(true)
	// Five operators press retry at once: one resumes it, the others are
	// told it is no longer failed.
	var retried atomic.Int32
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for range 5 {
		wg.Go(func() {
			<-gate
			_, err := cl.Retry(ctx, res.ID, engine.Repair{})
			if err == nil {
				retried.Add(1)
				return
			}
			require.ErrorIs(t, err, engine.ErrStateForbids)
		})
	}
	close(gate)
	wg.Wait()
	require.EqualValues(t, 1, retried.Load())
	sg, err = cl.Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, sg.State)
	var undone int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from effects where step = 'a' and phase = 'compensate'`).Scan(&undone))
	require.Equal(t, 1, undone)

	// The timeline: a forward, b forward (failed), a compensate twice
	// failed with retry then failed, and the operator's third attempt.
	var outcomes []string
	for _, a := range sg.Attempts {
		outcomes = append(outcomes, a.Step+"/"+string(a.Phase)+"#"+itoa(a.Attempt)+":"+a.Outcome)
		require.Equal(t, saga.StepKey(sg.ID, a.Step, a.Phase), a.Key)
	}
	require.Equal(t, []string{"a/forward#1:succeeded", "b/forward#1:failed", "a/compensate#1:retry", "a/compensate#2:failed", "a/compensate#3:succeeded"}, outcomes)
	b, err := json.Marshal(sg)
	require.NoError(t, err)
	require.Contains(t, string(b), `"attempts"`)
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def, err := fixture.Transfer(saga.RetryPolicy{Timeout: time.Millisecond})
	require.NoError(t, err)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, LeaseGrace: time.Millisecond})
	require.NoError(t, err)
	for _, k := range []string{"a", "b", "c"} {
		_, err := cl.Start(ctx, def, k, transferInput(1, 2, 1))
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `update idemsaga.sagas set created_at = now() - interval '1 hour' where idem_key = 'a'`)
	require.NoError(t, err)
	all, err := cl.List(ctx, engine.ListOptions{Definition: "transfer"})
	require.NoError(t, err)
	require.Len(t, all, 3)
	old, err := cl.List(ctx, engine.ListOptions{OlderThan: 30 * time.Minute})
	require.NoError(t, err)
	require.Len(t, old, 1)
	require.Equal(t, "a", old[0].Key)
	_, err = cl.List(ctx, engine.ListOptions{Definition: "other"})
	require.ErrorIs(t, err, engine.ErrInvalidFilter, "no definition named other")
	// No worker runs: every lease expires at once, so all are stuck once
	// the database clock passed them.
	require.Eventually(t, func() bool {
		stuck, err := cl.List(ctx, engine.ListOptions{Stuck: true, StuckAfter: time.Millisecond})
		require.NoError(t, err)
		return len(stuck) == 3
	}, 10*time.Second, 5*time.Millisecond, "the three sagas are listed as stuck")
	limited, err := cl.List(ctx, engine.ListOptions{Limit: 2})
	require.NoError(t, err)
	require.Len(t, limited, 2)
}

func itoa(i int) string { return strconv.Itoa(i) }

// TestConcurrentCancels: four operators cancelling each of ten sagas at
// once: one wins each time, the others are refused, and every deduction is
// refunded once.
func TestConcurrentCancels(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 10_000)
	require.NoError(t, err)
	stream := testenv.Name("OPS")
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, SubjectPrefix: "t." + stream})
	require.NoError(t, err)
	var ids []saga.Instance
	for i := range 10 {
		res, err := cl.Start(ctx, def, "op-"+itoa(i), transferInput(1, 2, 5))
		require.NoError(t, err)
		ids = append(ids, saga.Instance{ID: res.ID})
	}
	gate := make(chan struct{})
	wins := make([]atomic.Int32, len(ids))
	var wg sync.WaitGroup
	for i := range ids {
		for range 4 {
			wg.Go(func() {
				<-gate
				_, err := cl.Cancel(ctx, ids[i].ID, engine.Repair{Reason: "race"})
				switch {
				case err == nil:
					wins[i].Add(1)
				case errors.Is(err, engine.ErrStateForbids):
				default:
					t.Errorf("cancel: %v", err)
				}
			})
		}
	}
	close(gate)
	wg.Wait()
	for i := range wins {
		require.EqualValues(t, 1, wins[i].Load(), "exactly one cancel of saga %d wins", i)
	}
	startEngine(t, pool, nc, stream, []*saga.Definition{def})
	waitAllFinished(t, pool, 30*time.Second)
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"compensated": 10}, rep.ByState)
}

// TestRepairKeyAbsorbsResends: twenty copies of one cancel request (one
// key), sent at once as a client that lost its answers would: one cancels,
// every other answers with that cancel's result and writes nothing; the
// same key with another reason is refused; a process without the
// definition's code (a client built with no definitions) repairs from the
// deployment's record.
func TestRepairKeyAbsorbsResends(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	_, err := fixture.Seed(ctx, pool, 2, 10_000)
	require.NoError(t, err)
	stream := testenv.Name("RESEND")
	cl := brokerClient(t, pool, stream, def)
	res, err := cl.Start(ctx, def, "resend", transferInput(1, 2, 5))
	require.NoError(t, err)

	codeless, err := engine.NewClient(engine.Config{Pool: pool, SubjectPrefix: "t." + stream, LeaseGrace: 10 * time.Second})
	require.NoError(t, err)
	const n = 20
	results := make([]engine.RepairResult, n)
	errs := make([]error, n)
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-gate
			who := cl
			if i%2 == 1 {
				who = codeless
			}
			results[i], errs[i] = who.Cancel(ctx, res.ID, engine.Repair{Key: "ticket-7", Reason: "customer asked", By: "ann"})
		})
	}
	close(gate)
	wg.Wait()
	fresh := 0
	for i := range n {
		require.NoError(t, errs[i], "copy %d", i)
		if !results[i].Replayed {
			fresh++
		}
		require.Equal(t, results[0].State, results[i].State)
		require.True(t, results[0].At.Equal(results[i].At), "every copy answers with the one repair's time")
	}
	require.Equal(t, 1, fresh, "exactly one copy cancelled")
	// Its deduction never ran: settled as not done, nothing to undo.
	require.Equal(t, saga.StateCompensated, results[0].State)
	require.EqualValues(t, 1, countSQL(t, pool, `select count(*) from idemsaga.repairs`))
	require.EqualValues(t, 1, countSQL(t, pool, `select count(*) from idemsaga.inbox where outcome = 'tombstone'`), "one cancel fenced the step")

	_, err = cl.Cancel(ctx, res.ID, engine.Repair{Key: "ticket-7", Reason: "another reason"})
	require.ErrorIs(t, err, engine.ErrRepairKeyReused)
	_, err = cl.Retry(ctx, res.ID, engine.Repair{Key: "ticket-7"})
	require.ErrorIs(t, err, engine.ErrRepairKeyReused)
	_, err = cl.Cancel(ctx, res.ID, engine.Repair{Key: "ticket-8"})
	require.ErrorIs(t, err, engine.ErrStateForbids, "a new key is a new request, which the state refuses")
	require.ErrorContains(t, err, "compensated")
	require.EqualValues(t, 1, countSQL(t, pool, `select count(*) from idemsaga.repairs`), "refusals write nothing")
}

// TestCancelWaitsForAnExternalCallInFlight: a cancel that arrives while
// an external step is calling the other system does not compensate it
// before the call's outcome is known (the undo could otherwise reach the
// other system first, and the call land after it): it waits for the
// attempt, then compensates what the call did.
func TestCancelWaitsForAnExternalCallInFlight(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var events []string
	record := func(e string) { mu.Lock(); events = append(events, e); mu.Unlock() }
	calling := make(chan struct{})
	release := make(chan struct{})
	def := saga.MustNew("pay",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				close(calling)
				<-release
				record("charge")
				return nil, nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				record("refund")
				return nil, nil
			}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep,
			Retry: saga.RetryPolicy{MaxBackoff: 2 * time.Hour},
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.RetryAfter(saga.NotApplied(errors.New("the warehouse opens tomorrow")), time.Hour)
			}},
	)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "p-1", map[string]int{})
	require.NoError(t, err)
	<-calling
	// A caller that cannot wait long hears why, before its deadline.
	short, stop := context.WithTimeout(ctx, 2*time.Second)
	_, err = env.Client.Cancel(short, res.ID, engine.Repair{Reason: "in a hurry"})
	stop()
	var inFlight *engine.StepInFlightError
	require.ErrorAs(t, err, &inFlight)
	require.Equal(t, "charge", inFlight.Step)
	require.False(t, inFlight.Until.IsZero())
	cancelled := make(chan error, 1)
	go func() {
		_, err := env.Client.Cancel(ctx, res.ID, engine.Repair{Reason: "customer asked"})
		cancelled <- err
	}()
	select {
	case err := <-cancelled:
		t.Fatalf("the cancel returned while the call was in flight: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-cancelled)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"charge", "refund"}, events, "the refund came after the charge it undoes")
}

// TestListRefusesFiltersNoSagaMatches: a typo in a filter is an error
// that lists what exists, not an empty list.
func TestListRefusesFiltersNoSagaMatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl := brokerClient(t, pool, testenv.Name("FILTER"), def)
	require.NoError(t, cl.Check(ctx))
	_, err := cl.List(ctx, engine.ListOptions{State: "parkd"})
	require.ErrorIs(t, err, engine.ErrInvalidFilter)
	require.ErrorContains(t, err, "the states are closed, compensated, compensating, credited, deducted, failed, init, parked")
	_, err = cl.List(ctx, engine.ListOptions{Definition: "transfr"})
	require.ErrorIs(t, err, engine.ErrInvalidFilter)
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
	_, err = cl.List(ctx, engine.ListOptions{Definition: "transfer", State: "credited"})
	require.NoError(t, err)
	_, err = cl.List(ctx, engine.ListOptions{State: "parked"})
	require.NoError(t, err)
}
