package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// otherSystem is a payment service that takes the step key as its
// idempotency key: calls counts every call, effects the ones that took
// effect (one per key).
type otherSystem struct {
	mu      sync.Mutex
	calls   int
	effects map[uuid.UUID]int
}

func (o *otherSystem) call(key uuid.UUID) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls++
	if o.effects == nil {
		o.effects = map[uuid.UUID]int{}
	}
	o.effects[key] = 1
}

func (o *otherSystem) counts() (calls, effects int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls, len(o.effects)
}

// payDef is a charge at another system (no compensation: a given-up
// charge parks the saga) and a shipment that reads the charge's result.
func payDef(o *otherSystem) *saga.Definition {
	return saga.MustNew("pay",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep,
			Retry: saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond},
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				o.call(sc.Key)
				return json.RawMessage(`{"txn":"auto"}`), nil
			}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				var charge struct {
					Txn string `json:"txn"`
				}
				if _, err := sc.DecodeResult("charge", &charge); err != nil {
					return nil, saga.Permanent(err)
				}
				_, err := sc.Tx.Exec(ctx, `insert into shipped (saga_id, txn) values ($1, $2)`, sc.SagaID, charge.Txn)
				return nil, err
			}},
	)
}

func payEnv(t *testing.T, defs ...*saga.Definition) *sagatest.Env {
	t.Helper()
	return sagatest.New(t, sagatest.Config{Definitions: defs, Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `create table shipped (saga_id uuid primary key, txn text not null)`)
		return err
	}})
}

// parked runs a pay saga whose charge outcome is lost on both attempts:
// possibly done, no compensation, parked.
func parked(t *testing.T, env *sagatest.Env, def *saga.Definition, key string) *saga.Instance {
	t.Helper()
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Times: 2})
	sg := env.Run(t, def, key, map[string]int{})
	require.Equal(t, saga.StateParked, sg.State, sg.Error)
	require.Contains(t, sg.Error, "`skip "+sg.ID.String()+" --step charge")
	require.Contains(t, sg.Error, "`close "+sg.ID.String())
	return sg
}

func noDifferences(t *testing.T, pool *pgxpool.Pool, defs ...*saga.Definition) {
	t.Helper()
	diffs, err := engine.Reconcile(context.Background(), pool, defs, time.Hour)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// TestSkipParkedStep: a person checked the other system and the parked
// charge did go through; eight copies of one skip (one key) sent at once
// mark it succeeded once with the given result, the saga goes on and
// completes with it, and a late delivery of the charge's last attempt is
// answered from its key's tombstone without calling again.
func TestSkipParkedStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	sg := parked(t, env, def, "p-1")

	_, err := env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"txn":"T-1","txn":"T-2"}`)}, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrInvalidResult, "a duplicate member is refused")
	_, err = env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "ship", Result: json.RawMessage(`{}`)}, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, `at step "charge" (forward), not "ship"`)

	const n = 8
	results := make([]engine.RepairResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			results[i], errs[i] = env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(` {"txn": "T-1"} `)},
				engine.Repair{Key: "ticket-9", Reason: "the bank shows T-1", By: "ann"})
		})
	}
	close(gate)
	wg.Wait()
	fresh := 0
	for i := range n {
		require.NoError(t, errs[i])
		if !results[i].Replayed {
			fresh++
		}
	}
	require.Equal(t, 1, fresh, "one skip, the other copies replayed")
	_, err = env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"txn":"T-9"}`)}, engine.Repair{Key: "ticket-9", Reason: "the bank shows T-1"})
	require.ErrorIs(t, err, engine.ErrRepairKeyReused, "the same key with another result")

	done := env.Wait(t, sg.ID)
	require.Equal(t, saga.State("shipped"), done.State)
	require.JSONEq(t, `{"txn":"T-1"}`, string(done.Results["charge"]))
	var txn string
	require.NoError(t, env.Pool.QueryRow(ctx, `select txn from shipped where saga_id = $1`, sg.ID).Scan(&txn))
	require.Equal(t, "T-1", txn, "the next step read the operator's result")
	calls, effects := o.counts()
	require.Equal(t, 2, calls, "the skip called nobody")
	require.Equal(t, 1, effects, "one key at the other system")

	require.Len(t, done.Repairs, 1)
	rep := done.Repairs[0]
	require.Equal(t, "skip", rep.Operation)
	require.Equal(t, "ticket-9", rep.Key)
	require.Equal(t, "ann", rep.By)
	require.Equal(t, "the bank shows T-1", rep.Reason)
	require.Equal(t, "charge", rep.Step)
	require.Equal(t, saga.PhaseForward, rep.Phase)
	require.Equal(t, saga.State("charged"), rep.StateAfter)
	var timeline []string
	for _, a := range done.Attempts {
		if a.Step == "charge" {
			timeline = append(timeline, itoa(a.Attempt)+":"+a.Outcome+":"+a.Error)
		}
	}
	require.Len(t, timeline, 3)
	require.Equal(t, "3:succeeded:skipped by an operator (ann): the bank shows T-1", timeline[2])

	// A late copy of the charge's attempt 2.
	w := newReplyWorker(t, env.Pool, "sagatest", 0, def)
	r, err := w.Handle(ctx, wire.Command{SagaID: sg.ID, Definition: def.Name(), Step: "charge", Phase: saga.PhaseForward,
		Key: saga.StepKey(sg.ID, "charge", saga.PhaseForward), Attempt: 2, Input: sg.Input})
	require.NoError(t, err)
	require.True(t, r.Duplicate, "the skipped key is fenced")
	calls, _ = o.counts()
	require.Equal(t, 2, calls)
	noDifferences(t, env.Pool, def)
}

// TestSkipRacesTheWorkersAttempt: a skip sent while the step's own
// attempt runs waits for it: an attempt that took effect is applied with
// its own result and the skip refused; one that failed is skipped. The
// step's effect happens at most once either way.
func TestSkipRacesTheWorkersAttempt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		succeed bool
	}{{"attempt succeeds", true}, {"attempt fails", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			entered := make(chan struct{})
			release := make(chan struct{})
			var once sync.Once
			def := saga.MustNew("race",
				saga.Step{Name: "book", Reaches: "booked", Kind: saga.DatabaseStep,
					Retry: saga.RetryPolicy{MaxBackoff: 2 * time.Hour},
					Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
						if _, err := sc.Tx.Exec(ctx, `insert into shipped (saga_id, txn) values ($1, 'own')`, sc.SagaID); err != nil {
							return nil, err
						}
						once.Do(func() { close(entered) })
						<-release
						if !tc.succeed {
							return nil, saga.RetryAfter(errors.New("the booking system is down"), time.Hour)
						}
						return json.RawMessage(`"own"`), nil
					}},
				saga.Step{Name: "notify", Reaches: "notified", Kind: saga.DatabaseStep,
					Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
			)
			env := payEnv(t, def)
			// Started alone, so the saga is there while its first step runs.
			res, err := startAlone(t, env.Pool, env.Client, def, "r-1", map[string]int{})
			require.NoError(t, err)
			<-entered
			skipped := make(chan error, 1)
			go func() {
				_, err := env.Client.Skip(ctx, res.ID, engine.SkipStep{Step: "book", Result: json.RawMessage(`"by hand"`)}, engine.Repair{Reason: "booked by phone"})
				skipped <- err
			}()
			close(release)
			err = <-skipped
			sg := env.Wait(t, res.ID)
			require.Equal(t, saga.State("notified"), sg.State)
			own := countSQL(t, env.Pool, `select count(*) from shipped where saga_id = $1`, res.ID)
			if tc.succeed {
				require.ErrorIs(t, err, engine.ErrStateForbids)
				require.JSONEq(t, `"own"`, string(sg.Results["book"]))
				require.EqualValues(t, 1, own)
				require.Empty(t, sg.Repairs, "a refused skip is not recorded")
			} else {
				require.NoError(t, err)
				require.JSONEq(t, `"by hand"`, string(sg.Results["book"]))
				require.EqualValues(t, 0, own, "the failed attempt rolled back, and no attempt ran after the skip")
				require.Len(t, sg.Repairs, 1)
			}
			noDifferences(t, env.Pool, def)
		})
	}
}

// TestRetryNowOfAWaitingStep: a step waiting out an hour's backoff is
// retried now, under its key at its next attempt, without the clock
// moving; ten copies of the request (one key) retry it once. Retry
// refuses, saying why, what cannot be retried.
func TestRetryNowOfAWaitingStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := saga.MustNew("ship",
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.ExternalStep,
			Retry: saga.RetryPolicy{MaxBackoff: 2 * time.Hour},
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				o.call(sc.Key)
				if sc.Attempt == 1 {
					return nil, saga.RetryAfter(saga.NotApplied(errors.New("the warehouse opens tomorrow")), time.Hour)
				}
				return nil, nil
			}},
	)
	env := payEnv(t, def)
	res, err := env.Client.Start(ctx, def, "s-1", map[string]int{})
	require.NoError(t, err)
	waitSQL(t, env.Pool, `select count(*) from idemsaga.steps where saga_id = $1 and status = 'retrying'`, res.ID)

	const n = 10
	results := make([]engine.RepairResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			results[i], errs[i] = env.Client.Retry(ctx, res.ID, engine.Repair{Key: "now", Reason: "the warehouse opened early"})
		})
	}
	close(gate)
	wg.Wait()
	fresh := 0
	for i := range n {
		require.NoError(t, errs[i])
		if !results[i].Replayed {
			fresh++
		}
	}
	require.Equal(t, 1, fresh)
	waitSQL(t, env.Pool, `select count(*) from idemsaga.sagas where id = $1 and finished_at is not null`, res.ID)
	offset, err := env.Clock.Offset(ctx)
	require.NoError(t, err)
	require.Zero(t, offset, "nobody moved the clock: the retry ran now")
	sg, err := env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("shipped"), sg.State)
	calls, effects := o.counts()
	require.Equal(t, 2, calls)
	require.Equal(t, 1, effects, "both attempts under one key")

	_, err = env.Client.Retry(ctx, res.ID, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, "completed")
	noDifferences(t, env.Pool, def)
}

// TestRetryRefusals: what Retry cannot do is refused, saying why.
func TestRetryRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	calling := make(chan struct{})
	release := make(chan struct{})
	def := saga.MustNew("refuse",
		saga.Step{Name: "hold", Reaches: "held", Kind: saga.DatabaseStep,
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				if string(sc.Input) == `{"wait":1}` {
					close(calling)
					<-release
				}
				return nil, nil
			}},
		saga.Step{Name: "fail", Reaches: "done", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.Permanent(errors.New("declined"))
			}},
	)
	env := payEnv(t, def)
	sg := env.Run(t, def, "c-1", map[string]int{})
	require.Equal(t, saga.StateCompensated, sg.State)
	_, err := env.Client.Retry(ctx, sg.ID, engine.Repair{})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, "start a new saga with a new key")

	// Started alone, so the saga is there while its first step runs.
	res, err := startAlone(t, env.Pool, env.Client, def, "c-2", map[string]int{"wait": 1})
	require.NoError(t, err)
	<-calling
	short, stop := context.WithTimeout(ctx, 2*time.Second)
	_, err = env.Client.Retry(short, res.ID, engine.Repair{})
	stop()
	require.ErrorIs(t, err, engine.ErrStateForbids)
	require.ErrorContains(t, err, "is running attempt 1")
	close(release)
	env.Wait(t, res.ID)
	require.Zero(t, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs`), "refusals write nothing")
}

// TestCloseFailedAndParked: a parked and a failed saga are closed as
// handled; ten operators closing at once close each once; nothing runs
// after, every other repair is refused, a late delivery changes nothing,
// and reconcile finds nothing left to do.
func TestCloseFailedAndParked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	quick := saga.RetryPolicy{MaxAttempts: 1}
	failing := saga.MustNew("undo",
		saga.Step{Name: "a", Reaches: "a_done", Kind: saga.DatabaseStep, CompensateRetry: quick,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.Permanent(errors.New("refund service refuses"))
			}},
		saga.Step{Name: "b", Reaches: "b_done", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.Permanent(errors.New("declined"))
			}},
	)
	env := payEnv(t, def, failing)
	p := parked(t, env, def, "p-1")
	f := env.Run(t, failing, "f-1", map[string]int{})
	require.Equal(t, saga.StateFailed, f.State)
	require.Contains(t, f.Error, "`close "+f.ID.String())
	require.Contains(t, f.Error, "`skip "+f.ID.String()+" --step a")

	for _, id := range []uuid.UUID{p.ID, f.ID} {
		var wg sync.WaitGroup
		wins := make(chan engine.RepairResult, 10)
		for i := range 10 {
			wg.Go(func() {
				res, err := env.Client.Close(ctx, id, engine.Repair{Key: "close-" + itoa(i), Reason: "refunded by hand", By: "bob"})
				if err == nil {
					wins <- res
					return
				}
				require.ErrorIs(t, err, engine.ErrStateForbids)
				require.ErrorContains(t, err, "already closed")
			})
		}
		wg.Wait()
		close(wins)
		require.Len(t, wins, 1)
		res := <-wins
		require.Equal(t, saga.StateClosed, res.State)
		require.Contains(t, []saga.State{saga.StateParked, saga.StateFailed}, res.Before)

		sg, err := env.Client.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, saga.StateClosed, sg.State)
		require.NotNil(t, sg.FinishedAt)
		require.Len(t, sg.Repairs, 1)
		require.Equal(t, "close", sg.Repairs[0].Operation)
		require.Equal(t, "bob", sg.Repairs[0].By)
		for name, try := range map[string]func() error{
			"retry":  func() error { _, err := env.Client.Retry(ctx, id, engine.Repair{}); return err },
			"cancel": func() error { _, err := env.Client.Cancel(ctx, id, engine.Repair{}); return err },
			"skip": func() error {
				_, err := env.Client.Skip(ctx, id, engine.SkipStep{Step: "charge"}, engine.Repair{})
				return err
			},
		} {
			require.ErrorIs(t, try(), engine.ErrStateForbids, name)
		}
	}
	// A late copy of the parked charge's last attempt.
	w := newReplyWorker(t, env.Pool, "sagatest", 0, def)
	r, err := w.Handle(ctx, wire.Command{SagaID: p.ID, Definition: def.Name(), Step: "charge", Phase: saga.PhaseForward,
		Key: saga.StepKey(p.ID, "charge", saga.PhaseForward), Attempt: 2, Input: p.Input})
	require.NoError(t, err)
	require.True(t, r.Duplicate)
	calls, _ := o.counts()
	require.Equal(t, 2, calls)
	require.EqualValues(t, 2, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs`))
	noDifferences(t, env.Pool, def, failing)
}

// TestSkipFailedCompensation: a compensation that cannot finish is
// skipped (a person refunded by hand): the next compensation runs and the
// saga ends compensated.
func TestSkipFailedCompensation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var mu sync.Mutex
	var undone []string
	undo := func(name string, fail bool) saga.HandlerFunc {
		return func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			if fail {
				return nil, saga.Permanent(errors.New("refund service refuses"))
			}
			mu.Lock()
			undone = append(undone, name)
			mu.Unlock()
			return nil, nil
		}
	}
	ok := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def := saga.MustNew("undo2",
		saga.Step{Name: "a", Reaches: "a_done", Kind: saga.DatabaseStep, Forward: ok, Compensate: undo("a", false)},
		saga.Step{Name: "b", Reaches: "b_done", Kind: saga.DatabaseStep, Forward: ok, Compensate: undo("b", true), CompensateRetry: saga.RetryPolicy{MaxAttempts: 1}},
		saga.Step{Name: "c", Reaches: "c_done", Kind: saga.DatabaseStep, Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, saga.Permanent(errors.New("declined"))
		}},
	)
	env := payEnv(t, def)
	sg := env.Run(t, def, "u-1", map[string]int{})
	require.Equal(t, saga.StateFailed, sg.State)
	res, err := env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "b"}, engine.Repair{Reason: "refunded by hand"})
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensating, res.State)
	done := env.Wait(t, sg.ID)
	require.Equal(t, saga.StateCompensated, done.State)
	mu.Lock()
	require.Equal(t, []string{"a"}, undone)
	mu.Unlock()
	require.Equal(t, saga.PhaseCompensate, done.Repairs[0].Phase)
	noDifferences(t, env.Pool, def)
}

// TestRetryParkedStepWorkerKilled: the retried attempt of a parked charge
// commits its outcome and its worker dies before acknowledging or
// carrying the saga on: the saga still completes, every attempt under the
// one key, the charge taking effect once.
func TestRetryParkedStepWorkerKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	sg := parked(t, env, def, "k-1")
	env.Inject(sagatest.Fault{Kind: sagatest.CrashAfterCommit, Step: "charge", Attempt: 3})
	res, err := env.Client.Retry(ctx, sg.ID, engine.Repair{Reason: "the bank is back"})
	require.NoError(t, err)
	require.Equal(t, saga.StateInit, res.State)
	done := env.Wait(t, sg.ID)
	require.Equal(t, saga.State("shipped"), done.State)
	require.Equal(t, 1, env.Fired(sagatest.CrashAfterCommit))
	calls, effects := o.counts()
	require.Equal(t, 3, calls)
	require.Equal(t, 1, effects)
	for _, a := range done.Attempts {
		require.Equal(t, saga.StepKey(sg.ID, a.Step, a.Phase), a.Key)
	}
	noDifferences(t, env.Pool, def)
}

// TestSkipWhileTheWorkerIsDead: a charge's worker died during its call
// (the outcome is lost, its lease runs): a skip refuses while the call may
// be in flight, and once the lease ran out and the step parked, skips it;
// the dead attempt's late delivery takes no effect.
func TestSkipWhileTheWorkerIsDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Times: 2})
	res, err := env.Client.Start(ctx, def, "d-1", map[string]int{})
	require.NoError(t, err)
	waitSQL(t, env.Pool, `select count(*) from idemsaga.inbox where saga_id = $1 and outcome = 'started'`, res.ID)
	short, stop := context.WithTimeout(ctx, 2*time.Second)
	_, err = env.Client.Skip(short, res.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"txn":"T-5"}`)}, engine.Repair{})
	stop()
	var inFlight *engine.StepInFlightError
	require.ErrorAs(t, err, &inFlight)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.StateParked, sg.State)
	_, err = env.Client.Skip(ctx, res.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"txn":"T-5"}`)}, engine.Repair{})
	require.NoError(t, err)
	done := env.Wait(t, res.ID)
	require.Equal(t, saga.State("shipped"), done.State)
	w := newReplyWorker(t, env.Pool, "sagatest", 0, def)
	for attemptNo := 1; attemptNo <= 2; attemptNo++ {
		r, err := w.Handle(ctx, wire.Command{SagaID: res.ID, Definition: def.Name(), Step: "charge", Phase: saga.PhaseForward,
			Key: saga.StepKey(res.ID, "charge", saga.PhaseForward), Attempt: attemptNo, Input: sg.Input})
		require.NoError(t, err)
		require.True(t, r.Duplicate)
	}
	calls, effects := o.counts()
	require.Equal(t, 2, calls)
	require.Equal(t, 1, effects)
	noDifferences(t, env.Pool, def)
}

// waitSQL waits until query (one count) is positive, for up to 30 s.
func waitSQL(t *testing.T, pool *pgxpool.Pool, query string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for countSQL(t, pool, query, args...) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("still none after 30s: %s", query)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestReconcileChecksRepairs: a skipped step whose key lost its fence,
// and a saga closed with no close recorded, are differences.
func TestReconcileChecksRepairs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	sg := parked(t, env, def, "r-1")
	_, err := env.Client.Skip(ctx, sg.ID, engine.SkipStep{Step: "charge", Result: json.RawMessage(`{"txn":"T"}`)}, engine.Repair{})
	require.NoError(t, err)
	env.Wait(t, sg.ID)
	noDifferences(t, env.Pool, def)
	other := parked(t, env, def, "r-2")

	_, err = env.Pool.Exec(ctx, `update idemsaga.inbox set outcome = 'retry' where saga_id = $1 and step = 'charge'`, sg.ID)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `update idemsaga.sagas set state = 'closed' where id = $1`, other.ID) // not by Close
	require.NoError(t, err)
	diffs, err := engine.Reconcile(ctx, env.Pool, []*saga.Definition{def}, time.Hour)
	require.NoError(t, err)
	var got []string
	for _, d := range diffs {
		got = append(got, d.String())
	}
	require.ElementsMatch(t, []string{
		"saga " + sg.ID.String() + ": step skipped by an operator is not fenced: charge/forward is succeeded, its key holds retry",
		"saga " + other.ID.String() + ": closed with no close recorded in its repairs",
	}, got)
}

// TestCancelParkedStepTakenAsNotDone: a person found that the parked
// charge did not go through and cancels the saga. The saga compensates
// what came before it (nothing here), ends compensated, and reconcile
// reads the operator's word: the possibly-done charge, never compensated,
// is no difference.
func TestCancelParkedStepTakenAsNotDone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	sg := parked(t, env, def, "p-cancel")

	res, err := env.Client.Cancel(ctx, sg.ID, engine.Repair{Key: "ticket-12", Reason: "the bank shows no charge", By: "ann"})
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, res.State)
	done := env.Wait(t, sg.ID)
	require.Equal(t, saga.StateCompensated, done.State)
	require.Len(t, done.Repairs, 1)
	require.Equal(t, "cancel", done.Repairs[0].Operation)
	require.Equal(t, "charge", done.Repairs[0].Step, "the cancel names the step it took as not done")
	require.Equal(t, saga.PhaseForward, done.Repairs[0].Phase)
	noDifferences(t, env.Pool, def)
}
