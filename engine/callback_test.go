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
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// channel is a payment channel that takes requests and answers by
// callback: it counts requests per key and records what it was asked to
// refund.
type channel struct {
	mu       sync.Mutex
	requests map[uuid.UUID]int
	refunds  map[uuid.UUID]int
	tokens   chan string
	// before, if set, runs inside the request before it is accepted (a
	// callback that races the answer).
	before func(token string)
}

func newChannel() *channel {
	return &channel{requests: map[uuid.UUID]int{}, refunds: map[uuid.UUID]int{}, tokens: make(chan string, 100)}
}

func (ch *channel) definition(t *testing.T, wait time.Duration) *saga.Definition {
	t.Helper()
	noop := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	d, err := saga.New("pay", saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop, Retry: fastPolicy},
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.CallbackStep, Wait: wait, Retry: fastPolicy, CompensateRetry: fastPolicy,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				ch.mu.Lock()
				before := ch.before
				ch.mu.Unlock()
				if before != nil {
					before(sc.CallbackToken())
				}
				ch.mu.Lock()
				ch.requests[sc.Key]++
				ch.mu.Unlock()
				ch.tokens <- sc.CallbackToken()
				return json.RawMessage(`{"accepted":true}`), nil
			},
			Compensate: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				ch.mu.Lock()
				ch.refunds[sc.ForwardKey]++
				ch.mu.Unlock()
				return nil, nil
			}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Retry: fastPolicy,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				var paid struct{ Txn string }
				if ok, err := sc.DecodeResult("charge", &paid); err != nil || !ok {
					return nil, saga.Permanent(fmt.Errorf("no charge result: %v", err))
				}
				return json.Marshal(map[string]string{"shipped_for": paid.Txn})
			}})
	require.NoError(t, err)
	return d
}

// callBackFirst makes the channel call back once, with eventID and
// result, from inside the first request, before the step could record
// that the request was accepted (the callback races the answer).
func (ch *channel) callBackFirst(env *sagatest.Env, eventID, result string) {
	var first atomic.Bool
	ch.mu.Lock()
	defer ch.mu.Unlock()
	ch.before = func(token string) {
		if first.CompareAndSwap(false, true) {
			if _, err := env.Client.Complete(context.Background(), engine.Callback{Token: token, EventID: eventID, Result: json.RawMessage(result)}); err != nil {
				panic(err)
			}
		}
	}
}

func (ch *channel) token(t *testing.T) string {
	t.Helper()
	select {
	case tok := <-ch.tokens:
		return tok
	case <-time.After(30 * time.Second):
		t.Fatal("the callback step sent no request")
		return ""
	}
}

// waitStatus waits until step of saga id has status.
func waitStatus(t *testing.T, env *sagatest.Env, id uuid.UUID, step string, status saga.StepStatus) {
	t.Helper()
	require.Eventually(t, func() bool {
		var s string
		err := env.Pool.QueryRow(context.Background(), `select status from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'`, id, step).Scan(&s)
		return err == nil && s == string(status)
	}, 30*time.Second, 5*time.Millisecond)
}

func TestCallbackDeliveredTenTimesConcurrently(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-1", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)

	// The channel calls back ten times at once with its transaction
	// number, and once more later with another event for the same step.
	const n = 10
	results := make([]engine.CallbackResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-42", Result: json.RawMessage(`{"Txn": "txn-42"}`)})
		}()
	}
	wg.Wait()
	applied := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, engine.CallbackApplied, results[i].Outcome)
		if !results[i].Replayed {
			applied++
		}
	}
	require.Equal(t, 1, applied, "exactly one delivery decides")

	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.State("shipped"), sg.State)
	require.JSONEq(t, `{"shipped_for":"txn-42"}`, string(sg.Results["ship"]))
	require.JSONEq(t, `{"Txn":"txn-42"}`, string(sg.Results["charge"]))
	require.Len(t, sg.Callbacks, 1)
	require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)

	// Once more, same body with other spacing: a replay. Another body:
	// refused. Another event for the completed step: superseded.
	again, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-42", Result: json.RawMessage(`{ "Txn":"txn-42" }`)})
	require.NoError(t, err)
	require.True(t, again.Replayed)
	_, err = env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-42", Result: json.RawMessage(`{"Txn":"txn-43"}`)})
	require.ErrorIs(t, err, engine.ErrCallbackReused)
	other, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-99", Result: json.RawMessage(`{"Txn":"txn-99"}`)})
	require.NoError(t, err)
	require.Equal(t, engine.CallbackLate, other.Outcome, "the saga finished")

	sg, err = env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Len(t, sg.Callbacks, 2)
	require.Equal(t, saga.State("shipped"), sg.State)
	require.Equal(t, 1, ch.requests[saga.StepKey(res.ID, "charge", saga.PhaseForward)])
	diffs, err := engine.Reconcile(ctx, env.Pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

func TestCallbackBeforeTheRequestIsRecorded(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	var env *sagatest.Env
	var first atomic.Bool
	// The channel calls back (twice) from inside the request, before the
	// step has recorded that its request was accepted.
	ch.before = func(token string) {
		if !first.CompareAndSwap(false, true) {
			return
		}
		for range 2 {
			r, err := env.Client.Complete(context.Background(), engine.Callback{Token: token, EventID: "early", Result: json.RawMessage(`{"Txn":"early"}`)})
			if err != nil || r.Outcome != engine.CallbackPending {
				panic(fmt.Sprintf("early callback: %+v %v", r, err))
			}
		}
	}
	def := ch.definition(t, 0)
	env = sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	sg := env.Run(t, def, "order-early", map[string]int{"amount": 5})
	require.Equal(t, saga.State("shipped"), sg.State)
	require.JSONEq(t, `{"shipped_for":"early"}`, string(sg.Results["ship"]))
	require.Len(t, sg.Callbacks, 1)
	require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)
	require.NotNil(t, sg.Callbacks[0].AppliedAt)
}

func TestCallbackRefusalCompensates(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-refused", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	r, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "declined-1", Error: "card declined"})
	require.NoError(t, err)
	require.Equal(t, engine.CallbackApplied, r.Outcome)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "card declined")
	// Refused: nothing happened at the channel, so no refund of it.
	require.Zero(t, ch.refunds[saga.StepKey(res.ID, "charge", saga.PhaseForward)])
}

func TestCallbackWaitRunsOut(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, time.Hour)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-silent", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)

	// No callback within the hour (on the test clock): possibly done, so
	// its own compensation runs first, under the forward key.
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "no callback within 1h0m0s")
	fwd := saga.StepKey(res.ID, "charge", saga.PhaseForward)
	require.Equal(t, 1, ch.refunds[fwd])
	for _, st := range sg.Steps {
		if st.Step == "charge" && st.Phase == saga.PhaseForward {
			require.True(t, st.PossiblyDone)
		}
	}

	// The channel answers after all: late, recorded, nothing reopened.
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-late", Result: json.RawMessage(`{"Txn":"txn-late"}`)})
			require.NoError(t, err)
			require.Equal(t, engine.CallbackLate, r.Outcome)
			require.Equal(t, saga.StateCompensated, r.State)
		}()
	}
	wg.Wait()
	sg, err = env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Len(t, sg.Callbacks, 1)
	require.Equal(t, engine.CallbackLate, sg.Callbacks[0].Outcome)
	require.Equal(t, 1, ch.refunds[fwd])
}

func TestCancelAWaitingStepCompensatesIt(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-cancel", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	_, err = env.Client.Cancel(ctx, res.ID, engine.Repair{Reason: "customer left"})
	require.NoError(t, err)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Equal(t, 1, ch.refunds[saga.StepKey(res.ID, "charge", saga.PhaseForward)], "a request sent may have taken effect")
	r, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-after-cancel"})
	require.NoError(t, err)
	require.Equal(t, engine.CallbackLate, r.Outcome)
}

func TestCompleteRefusals(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-bad", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	for name, tc := range map[string]struct {
		cb   engine.Callback
		want error
	}{
		"bad token":      {engine.Callback{Token: "nope", EventID: "e"}, saga.ErrInvalidCallbackToken},
		"unknown saga":   {engine.Callback{Token: saga.CallbackToken(uuid.Must(uuid.NewV7()), "charge"), EventID: "e"}, saga.ErrNotFound},
		"unknown step":   {engine.Callback{Token: saga.CallbackToken(res.ID, "nope"), EventID: "e"}, engine.ErrNotCallbackStep},
		"not a callback": {engine.Callback{Token: saga.CallbackToken(res.ID, "reserve"), EventID: "e"}, engine.ErrNotCallbackStep},
		"no event id":    {engine.Callback{Token: token}, engine.ErrInvalidCallback},
		"bad event id":   {engine.Callback{Token: token, EventID: " e"}, engine.ErrInvalidCallback},
		"bad result":     {engine.Callback{Token: token, EventID: "e", Result: json.RawMessage(`{"a":`)}, engine.ErrInvalidCallback},
		"both":           {engine.Callback{Token: token, EventID: "e", Result: json.RawMessage(`{}`), Error: "x"}, engine.ErrInvalidCallback},
	} {
		_, err := env.Client.Complete(ctx, tc.cb)
		require.ErrorIs(t, err, tc.want, name)
	}
	var n int
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*) from idemsaga.callbacks`).Scan(&n))
	require.Zero(t, n, "refusals write nothing")
	sg, err := env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("reserved"), sg.State)
}

func TestCallbackSurvivesALostRequestOutcome(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ch.callBackFirst(env, "txn-7", `{"Txn":"txn-7"}`)
	// The request reaches the channel, which calls back, and then the
	// worker loses the request's answer: the lease runs out and the
	// request is sent again under the same key; the kept callback
	// completes the step once the step waits.
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 1})
	sg := env.Run(t, def, "order-lost", map[string]int{"amount": 5})
	require.Equal(t, 1, env.Fired(sagatest.LoseOutcome))
	require.Equal(t, saga.State("shipped"), sg.State)
	require.JSONEq(t, `{"shipped_for":"txn-7"}`, string(sg.Results["ship"]))
	require.Equal(t, 2, ch.requests[saga.StepKey(sg.ID, "charge", saga.PhaseForward)], "sent again under its key")
	require.Len(t, sg.Callbacks, 1)
	require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)
}

func TestReconcileChecksCallbacks(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	done, err := env.Client.Start(ctx, def, "done", map[string]int{"amount": 5})
	require.NoError(t, err)
	_, err = env.Client.Complete(ctx, engine.Callback{Token: ch.token(t), EventID: "e-1", Result: json.RawMessage(`{"Txn":"e-1"}`)})
	require.NoError(t, err)
	env.Wait(t, done.ID)
	waiting, err := env.Client.Start(ctx, def, "waiting", map[string]int{"amount": 5})
	require.NoError(t, err)
	ch.token(t)
	waitStatus(t, env, waiting.ID, "charge", saga.StepWaiting)
	defs := []*saga.Definition{def}
	diffs, err := engine.Reconcile(ctx, env.Pool, defs, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)

	plant := func(sql string, args ...any) {
		t.Helper()
		_, err := env.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	// A second event applied to the finished saga's step, and the step
	// rewound to failed; a pending event left beside a waiting step.
	plant(`insert into idemsaga.callbacks (definition, step, event_id, saga_id, body_hash, failed, outcome, detail) values ('pay', 'charge', 'e-2', $1, '\x00', false, 'applied', 'planted')`, done.ID)
	plant(`update idemsaga.steps set status = 'failed' where saga_id = $1 and step = 'charge' and phase = 'forward'`, done.ID)
	plant(`insert into idemsaga.callbacks (definition, step, event_id, saga_id, body_hash, failed, outcome, detail) values ('pay', 'charge', 'e-3', $1, '\x00', false, 'pending', 'planted')`, waiting.ID)
	diffs, err = engine.Reconcile(ctx, env.Pool, defs, time.Minute)
	require.NoError(t, err)
	var whats []string
	for _, d := range diffs {
		whats = append(whats, d.What)
	}
	require.Contains(t, whats, "several callbacks completed one step: charge: e-1, e-2")
	require.Contains(t, whats, "a callback completed a step that did not end as it said: charge event e-1: step failed")
	require.Contains(t, whats, "a callback is pending for a step that waits (it should have completed it): charge event e-3")
}

func TestKeptCallbackCompletesAStepWhoseAnswersWereAllLost(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ch.callBackFirst(env, "txn-kept", `{"Txn":"txn-kept"}`)
	// Every answer to the request is lost: the attempts run out, and the
	// step would be given up as possibly done and refunded; the callback
	// the channel sent says it took effect, and completes it.
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Times: fastPolicy.MaxAttempts})
	sg := env.Run(t, def, "order-all-lost", map[string]int{"amount": 5})
	require.Equal(t, fastPolicy.MaxAttempts, env.Fired(sagatest.LoseOutcome))
	require.Equal(t, saga.State("shipped"), sg.State)
	require.JSONEq(t, `{"shipped_for":"txn-kept"}`, string(sg.Results["ship"]))
	require.Zero(t, ch.refunds[saga.StepKey(sg.ID, "charge", saga.PhaseForward)])
	require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)
	diffs, err := engine.Reconcile(context.Background(), env.Pool, []*saga.Definition{def}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// waitingRow reads a forward step's status and how long until its lease.
func waitingRow(t *testing.T, env *sagatest.Env, id uuid.UUID, step string) (saga.StepStatus, time.Duration) {
	t.Helper()
	var status string
	var left time.Duration
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select status, coalesce(lease_until - idemsaga.now(), interval '0') from idemsaga.steps
where saga_id = $1 and step = $2 and phase = 'forward'`, id, step).Scan(&status, &left))
	return saga.StepStatus(status), left
}

func TestPauseHoldsACallbackWait(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, time.Hour)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-paused-wait", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	_, err = env.Client.Pause(ctx, res.ID, engine.Repair{Reason: "the channel is down"})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return countSQL(t, env.Pool, `select count(*) from idemsaga.outbox`) == 0 },
		30*time.Second, 5*time.Millisecond, "the broker took every message")

	// Three hours pass while paused: the wait of one hour is not given
	// up, and reconcile does not call it a difference.
	require.NoError(t, env.Clock.Advance(ctx, 3*time.Hour))
	_, err = env.Engine.ReapOnce(ctx)
	require.NoError(t, err)
	status, _ := waitingRow(t, env, res.ID, "charge")
	require.Equal(t, saga.StepWaiting, status)
	diffs, err := engine.Reconcile(ctx, env.Pool, []*saga.Definition{def}, time.Second)
	require.NoError(t, err)
	require.Empty(t, diffs)

	// Resumed, the wait goes on with what was left of it.
	_, err = env.Client.Resume(ctx, res.ID, engine.Repair{})
	require.NoError(t, err)
	_, err = env.Engine.ReapOnce(ctx)
	require.NoError(t, err)
	status, left := waitingRow(t, env, res.ID, "charge")
	require.Equal(t, saga.StepWaiting, status)
	require.Greater(t, left, 50*time.Minute, "the hour of waiting was held by the pause")
	_, err = env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-after-pause", Result: json.RawMessage(`{"Txn":"p"}`)})
	require.NoError(t, err)
	require.Equal(t, saga.State("shipped"), env.Wait(t, res.ID).State)
}

func TestRetryNowRefusesAWaitingStep(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-retry-waiting", map[string]int{"amount": 5})
	require.NoError(t, err)
	ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	_, err = env.Client.Retry(ctx, res.ID, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, "waits for the other system's callback")
	status, _ := waitingRow(t, env, res.ID, "charge")
	require.Equal(t, saga.StepWaiting, status, "nothing changed")
	require.Equal(t, 1, ch.requests[saga.StepKey(res.ID, "charge", saga.PhaseForward)])
}

func TestRetryOfAParkedCallbackStepAppliesItsLateCallback(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	d := ch.definition(t, time.Hour)
	steps := d.Steps()
	steps[1].Compensate = nil // the charge cannot be undone: a wait that runs out parks
	def, err := saga.New("pay", steps...)
	require.NoError(t, err)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-parked", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateParked, sg.State)

	// The channel's answer comes late: recorded, nothing reopened.
	r, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-late-1", Result: json.RawMessage(`{"Txn":"late-1"}`)})
	require.NoError(t, err)
	require.Equal(t, engine.CallbackLate, r.Outcome)
	// A person retries the step: its request goes again under its key,
	// and the callback already on record completes it once it waits.
	_, err = env.Client.Retry(ctx, res.ID, engine.Repair{Reason: "the channel says it charged"})
	require.NoError(t, err)
	sg = env.Wait(t, res.ID)
	require.Equal(t, saga.State("shipped"), sg.State)
	require.JSONEq(t, `{"shipped_for":"late-1"}`, string(sg.Results["ship"]))
	require.Equal(t, 2, ch.requests[saga.StepKey(res.ID, "charge", saga.PhaseForward)])
	require.Len(t, sg.Callbacks, 1)
	require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)
}

func TestBulkPauseAndResume(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, time.Hour)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	ids := map[uuid.UUID]string{}
	for i := range 4 {
		res, err := env.Client.Start(ctx, def, fmt.Sprintf("bulk-%d", i), map[string]int{"amount": 5})
		require.NoError(t, err)
		ids[res.ID] = ch.token(t)
		waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	}
	filter := engine.ListOptions{Definition: "pay", State: "reserved"}
	dry, err := env.Client.Bulk(ctx, engine.BulkRepair{Operation: "pause", Filter: filter, DryRun: true, Repair: engine.Repair{Key: "outage"}})
	require.NoError(t, err)
	require.Len(t, dry.Items, 4)
	var paused int
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where paused_at is not null`).Scan(&paused))
	require.Zero(t, paused, "a dry run writes nothing")

	for range 2 { // sent again after a lost answer: replayed
		res, err := env.Client.Bulk(ctx, engine.BulkRepair{Operation: "pause", Filter: filter, Repair: engine.Repair{Key: "outage", Reason: "channel down"}})
		require.NoError(t, err)
		require.Len(t, res.Items, 4)
		for _, it := range res.Items {
			require.NoError(t, it.Err)
		}
	}
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where paused_at is not null`).Scan(&paused))
	require.Equal(t, 4, paused)
	require.EqualValues(t, 4, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs where operation = 'pause'`))

	res, err := env.Client.Bulk(ctx, engine.BulkRepair{Operation: "resume", Filter: filter, Repair: engine.Repair{Key: "outage-over"}})
	require.NoError(t, err)
	require.Len(t, res.Items, 4)
	for id, token := range ids {
		_, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "txn-" + id.String(), Result: json.RawMessage(`{"Txn":"b"}`)})
		require.NoError(t, err)
		require.Equal(t, saga.State("shipped"), env.Wait(t, id).State)
	}
}

func TestKeptCallbackOfAStepThatNeverWaitsIsLate(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	d := ch.definition(t, 0)
	steps := d.Steps()
	// The first step waits out an hour's backoff: the saga never reaches
	// the charge before it is cancelled.
	steps[0].Retry = saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Hour, MaxBackoff: time.Hour, Jitter: -1}
	steps[0].Forward = func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, errors.New("not yet") }
	def, err := saga.New("pay", steps...)
	require.NoError(t, err)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-never", map[string]int{"amount": 5})
	require.NoError(t, err)
	waitStatus(t, env, res.ID, "reserve", saga.StepRetrying)
	cb := engine.Callback{Token: saga.CallbackToken(res.ID, "charge"), EventID: "txn-early", Result: json.RawMessage(`{"Txn":"e"}`)}
	r, err := env.Client.Complete(ctx, cb)
	require.NoError(t, err)
	require.Equal(t, engine.CallbackPending, r.Outcome)

	_, err = env.Client.Cancel(ctx, res.ID, engine.Repair{Reason: "customer left"})
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, env.Wait(t, res.ID).State)
	// Delivered again, the kept callback is late now: its step will never
	// wait.
	r, err = env.Client.Complete(ctx, cb)
	require.NoError(t, err)
	require.True(t, r.Replayed)
	require.Equal(t, engine.CallbackLate, r.Outcome)
	sg, err := env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, engine.CallbackLate, sg.Callbacks[0].Outcome)
	require.Zero(t, ch.requests[saga.StepKey(res.ID, "charge", saga.PhaseForward)], "the charge was never asked for")
}

func TestDeployRefusesAVersionChangedUnderItsSagas(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, time.Hour)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-deploy", map[string]int{"amount": 5})
	require.NoError(t, err)
	ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)

	changed := ch.definition(t, 2*time.Hour)
	err = engine.Deploy(ctx, engine.Config{Pool: env.Pool, Definitions: []*saga.Definition{changed}, Stream: "SAGATEST", SubjectPrefix: "sagatest"})
	require.ErrorIs(t, err, engine.ErrDeploymentMismatch)
	require.ErrorContains(t, err, `step "charge" wait`)
	require.ErrorContains(t, err, "saga.WithVersion(def, 2)")
	var fp string
	require.NoError(t, env.Pool.QueryRow(ctx, `select fingerprint from idemsaga.definitions where name = 'pay' and version = 1`).Scan(&fp))
	require.Equal(t, def.Describe().Fingerprint(), fp, "nothing was recorded")

	// As a version of its own, it is recorded beside the first.
	require.NoError(t, engine.Deploy(ctx, engine.Config{Pool: env.Pool, Definitions: []*saga.Definition{saga.WithVersion(changed, 2)},
		Stream: "SAGATEST", SubjectPrefix: "sagatest"}))
	require.EqualValues(t, 2, countSQL(t, env.Pool, `select count(*) from idemsaga.definitions where name = 'pay'`))
}

// TestCallbackResultChecked: a callback whose result its step's
// CheckCallback refuses (an amount other than the one asked for) is
// refused with ErrInvalidCallback and writes nothing; the right one is
// applied. A process with only the definition's description cannot
// check, and refuses it.
func TestCallbackResultChecked(t *testing.T) {
	t.Parallel()
	tokens := make(chan string, 4)
	noop := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	type pay struct {
		Amount int `json:"amount"`
	}
	def := saga.MustNew("checked",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.CallbackStep, Retry: fastPolicy, CompensateRetry: fastPolicy, Compensate: noop,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				tokens <- sc.CallbackToken()
				return nil, nil
			},
			CheckCallback: func(ctx context.Context, sc *saga.StepContext, result json.RawMessage) error {
				var asked, got pay
				if err := json.Unmarshal(sc.Input, &asked); err != nil {
					return err
				}
				if err := json.Unmarshal(result, &got); err != nil || got.Amount != asked.Amount {
					return fmt.Errorf("charged %d, asked %d", got.Amount, asked.Amount)
				}
				return nil
			}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Forward: noop, Retry: fastPolicy})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "o-1", pay{Amount: 5})
	require.NoError(t, err)
	token := <-tokens
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)

	_, err = env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "e-1", Result: json.RawMessage(`{"amount":50}`)})
	require.ErrorIs(t, err, engine.ErrInvalidCallback)
	require.ErrorContains(t, err, "charged 50, asked 5")
	var callbacks int
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*) from idemsaga.callbacks`).Scan(&callbacks))
	require.Zero(t, callbacks, "a refused callback writes nothing")

	remote, err := engine.NewClient(engine.Config{Pool: env.Pool, SubjectPrefix: "sagatest", LeaseGrace: 5 * time.Second})
	require.NoError(t, err)
	_, err = remote.Complete(ctx, engine.Callback{Token: token, EventID: "e-2", Result: json.RawMessage(`{"amount":5}`)})
	require.ErrorIs(t, err, engine.ErrInvalidCallback, "a process without the check's code refuses")

	got, err := env.Client.Complete(ctx, engine.Callback{Token: token, EventID: "e-2", Result: json.RawMessage(`{"amount":5}`)})
	require.NoError(t, err)
	require.Equal(t, engine.CallbackApplied, got.Outcome)
	require.Equal(t, saga.State("shipped"), env.Wait(t, res.ID).State)
}
