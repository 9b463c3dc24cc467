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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// waitUntil polls cond until it holds, failing the test after 30 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting, after 30s, for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stepRow reads one step's status and attempt ("" when it has no row).
func stepRow(t *testing.T, pool *pgxpool.Pool, id uuid.UUID, step string, phase saga.Phase) (string, int) {
	t.Helper()
	var status string
	var attemptNo int
	err := pool.QueryRow(context.Background(), `select status, attempt from idemsaga.steps where saga_id = $1 and step = $2 and phase = $3`,
		id, step, string(phase)).Scan(&status, &attemptNo)
	if err != nil {
		return "", 0
	}
	return status, attemptNo
}

// reapIdle runs reaper passes and requires that none moves anything.
func reapIdle(t *testing.T, e *engine.Engine) {
	t.Helper()
	for range 3 {
		n, err := e.ReapOnce(context.Background())
		require.NoError(t, err)
		require.Zero(t, n, "a reaper pass moved a step of a paused saga")
	}
}

// TestPauseAcrossALeaseExpiryAndRetries: a saga paused while its first
// step runs, then again while its second waits for a retry. The first
// finishes (a pause does not cut an attempt); the second's command is
// held, and neither an hour past its lease nor ten minutes past its retry
// time costs an attempt. Resumed, the saga finishes with the attempts it
// would have had without the pauses.
func TestPauseAcrossALeaseExpiryAndRetries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	var aCalls, bCalls, bMax atomic.Int32
	var down atomic.Bool
	down.Store(true)
	slow := saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: time.Minute, MaxBackoff: time.Minute, Jitter: -1, Timeout: 10 * time.Second}
	def := saga.MustNew("paused",
		saga.Step{Name: "a", Reaches: "a_done", Kind: saga.DatabaseStep, Retry: slow,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				aCalls.Add(1)
				entered <- struct{}{}
				<-gate
				return nil, nil
			}},
		saga.Step{Name: "b", Reaches: "b_done", Kind: saga.DatabaseStep, Retry: slow,
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				bCalls.Add(1)
				bMax.Store(max(bMax.Load(), int32(sc.Attempt)))
				if down.Load() {
					return nil, errors.New("the ledger is down")
				}
				return nil, nil
			}},
	)
	reg := prometheus.NewRegistry()
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Registerer: reg})
	cl := env.Client
	// Started alone, so the saga is there while its first step runs.
	res, err := startAlone(t, env.Pool, cl, def, "p-1", map[string]int{})
	require.NoError(t, err)
	<-entered

	// Eight copies of one request at once: one pause.
	pause := engine.Repair{Key: "pause-1", Reason: "ledger down", By: "test"}
	var applied atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			p, err := cl.Pause(ctx, res.ID, pause)
			require.NoError(t, err)
			if !p.Replayed {
				applied.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), applied.Load())
	_, err = cl.Pause(ctx, res.ID, engine.Repair{Reason: "twice"})
	require.ErrorIs(t, err, engine.ErrStateForbids)

	close(gate) // a finishes; b's command is held
	waitUntil(t, "b's command held", func() bool {
		return metricSum(t, reg, "idemsaga_commands_held_total", map[string]string{"step": "b"}) >= 1
	})
	status, attemptNo := stepRow(t, env.Pool, res.ID, "b", saga.PhaseForward)
	require.Equal(t, "dispatched", status)
	require.Equal(t, 1, attemptNo)
	require.NoError(t, env.Clock.Advance(ctx, time.Hour)) // far past b's lease
	reapIdle(t, env.Engine)
	status, attemptNo = stepRow(t, env.Pool, res.ID, "b", saga.PhaseForward)
	require.Equal(t, []any{"dispatched", 1, int32(0)}, []any{status, attemptNo, bCalls.Load()})
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.NotNil(t, sg.Paused)
	require.Empty(t, sg.Paused.Definition)

	applied.Store(0)
	for range 8 {
		wg.Go(func() {
			r, err := cl.Resume(ctx, res.ID, engine.Repair{Key: "resume-1", By: "test"})
			require.NoError(t, err)
			if !r.Replayed {
				applied.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), applied.Load())
	waitUntil(t, "b's first attempt to fail", func() bool {
		status, _ := stepRow(t, env.Pool, res.ID, "b", saga.PhaseForward)
		return status == "retrying"
	})
	_, err = cl.Pause(ctx, res.ID, engine.Repair{Key: "pause-2", Reason: "still down", By: "test"})
	require.NoError(t, err)
	require.NoError(t, env.Clock.Advance(ctx, 10*time.Minute)) // past several retry times
	reapIdle(t, env.Engine)
	status, attemptNo = stepRow(t, env.Pool, res.ID, "b", saga.PhaseForward)
	require.Equal(t, []any{"retrying", 1, int32(1)}, []any{status, attemptNo, bMax.Load()})

	down.Store(false) // the ledger is back
	_, err = cl.Resume(ctx, res.ID, engine.Repair{Key: "resume-2", By: "test"})
	require.NoError(t, err)
	sg = env.Wait(t, res.ID)
	require.Equal(t, saga.State("b_done"), sg.State)
	require.Nil(t, sg.Paused)
	require.Equal(t, int32(1), aCalls.Load())
	require.Equal(t, int32(2), bMax.Load(), "b ran at attempts 1 and 2 only")
	for _, st := range sg.Steps {
		want := map[string]int{"a": 1, "b": 2}[st.Step]
		require.Equal(t, want, st.Attempt, "step %s", st.Step)
	}
	for _, a := range sg.Attempts {
		require.NotEqual(t, "lease expired", a.Outcome, "no lease was taken over: %+v", a)
	}
	var ops []string
	rows, err := env.Pool.Query(ctx, `select operation || ':' || requested_by from idemsaga.repairs where saga_id = $1 order by created_at`, res.ID)
	require.NoError(t, err)
	for rows.Next() {
		var op string
		require.NoError(t, rows.Scan(&op))
		ops = append(ops, op)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"pause:test", "resume:test", "pause:test", "resume:test"}, ops)
	t.Logf("paused 1h past a lease and 10m (10 retry times) past a retry: b finished at attempt 2 (%d calls, a duplicate delivery of a failed attempt runs again)", bCalls.Load())
}

// TestPauseDefinition holds the sagas of a definition in flight and
// those started while it is paused; resumed, each finishes with one
// attempt per step. Eight requests under one key pause it once, and
// eight under another resume it once.
func TestPauseDefinition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const inFlight, arriving, requests = 5, 5, 8
	gate := make(chan struct{})
	var entered sync.WaitGroup
	entered.Add(inFlight)
	var calls atomic.Int32
	def := saga.MustNew("held",
		saga.Step{Name: "a", Reaches: "a_done", Kind: saga.DatabaseStep,
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				calls.Add(1)
				var n int
				if err := json.Unmarshal(sc.Input, &n); err == nil && n < inFlight {
					entered.Done()
					<-gate
				}
				return nil, nil
			}},
		saga.Step{Name: "b", Reaches: "b_done", Kind: saga.ExternalStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { calls.Add(1); return nil, nil }},
	)
	reg := prometheus.NewRegistry()
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Registerer: reg})
	cl := env.Client
	var ids []uuid.UUID
	for i := range inFlight {
		res, err := startAlone(t, env.Pool, cl, def, fmt.Sprintf("f-%d", i), i)
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	entered.Wait()

	results := make([]engine.DefinitionRepair, requests)
	var wg sync.WaitGroup
	for i := range requests {
		wg.Go(func() {
			var err error
			results[i], err = cl.PauseDefinition(ctx, def.Name(), engine.Repair{Key: "pause-all", Reason: "ledger down", By: "ops"})
			require.NoError(t, err)
		})
	}
	wg.Wait()
	fresh := 0
	for _, r := range results {
		if !r.Replayed {
			fresh++
		}
		require.Equal(t, inFlight, r.Sagas)
	}
	require.Equal(t, 1, fresh, "one pause, the other requests replayed it")
	_, err := cl.PauseDefinition(ctx, def.Name(), engine.Repair{Reason: "again"})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	paused, err := cl.PausedDefinitions(ctx)
	require.NoError(t, err)
	require.Len(t, paused, 1)
	require.Equal(t, []string{"held", "ledger down", "ops"}, []string{paused[0].Definition, paused[0].Reason, paused[0].By})

	close(gate) // the sagas in flight finish a; b is held
	for i := range arriving {
		res, err := cl.Start(ctx, def, fmt.Sprintf("n-%d", i), inFlight+i) // accepted, held
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	waitUntil(t, "every saga's command held", func() bool {
		return metricSum(t, reg, "idemsaga_commands_held_total", nil) >= inFlight+arriving
	})
	require.NoError(t, env.Clock.Advance(ctx, time.Hour))
	reapIdle(t, env.Engine)
	require.Equal(t, int32(inFlight), calls.Load(), "only the attempts begun before the pause ran")
	sg, err := cl.Get(ctx, ids[inFlight])
	require.NoError(t, err)
	require.Equal(t, &saga.Pause{Since: paused[0].Since, Definition: "held"}, sg.Paused)
	require.Equal(t, float64(inFlight+arriving), gauge(t, reg, "idemsaga_sagas_paused", "held"))

	var resumed atomic.Int32
	for range requests {
		wg.Go(func() {
			r, err := cl.ResumeDefinition(ctx, def.Name(), engine.Repair{Key: "resume-all", By: "ops"})
			require.NoError(t, err)
			require.Equal(t, inFlight+arriving, r.Sagas)
			if !r.Replayed {
				resumed.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), resumed.Load())
	for _, id := range ids {
		sg := env.Wait(t, id)
		require.Equal(t, saga.State("b_done"), sg.State)
		for _, st := range sg.Steps {
			require.Equal(t, 1, st.Attempt, "saga %s step %s", id, st.Step)
		}
	}
	require.Equal(t, int32(2*(inFlight+arriving)), calls.Load(), "each step ran once")
	require.Zero(t, gauge(t, reg, "idemsaga_sagas_paused", "held"))
	t.Logf("%d sagas in flight + %d started while paused: held, then each step ran once at attempt 1; %d pause and %d resume requests under one key each: 1 applied each",
		inFlight, arriving, requests, requests)
}

// TestPauseWhileAWorkerDiesInACall: an external step's call is in flight
// when its saga is paused, and its worker dies after the call, before
// recording the outcome. The pause holds the saga an hour past the
// lease; resumed, the attempt the worker died in is taken over as
// unknown (it was spent, not by the pause), and the same step key is
// called again: the other system applies it once.
func TestPauseWhileAWorkerDiesInACall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	gate, entered := make(chan struct{}), make(chan struct{}, 4)
	var mu sync.Mutex
	applied := map[uuid.UUID]int{}
	var calls atomic.Int32
	def := saga.MustNew("charge",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep,
			Forward: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				if calls.Add(1) == 1 {
					entered <- struct{}{}
					<-gate
				}
				mu.Lock()
				applied[sc.Key]++ // the other system dedups by the key
				mu.Unlock()
				return nil, nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
	)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 1})
	res, err := env.Client.Start(ctx, def, "c-1", map[string]int{})
	require.NoError(t, err)
	<-entered
	_, err = env.Client.Pause(ctx, res.ID, engine.Repair{Reason: "the gateway is flapping"})
	require.NoError(t, err)
	close(gate)
	waitUntil(t, "the worker to die after the call", func() bool { return env.Fired(sagatest.LoseOutcome) == 1 })
	require.NoError(t, env.Clock.Advance(ctx, time.Hour))
	reapIdle(t, env.Engine)
	status, attemptNo := stepRow(t, env.Pool, res.ID, "charge", saga.PhaseForward)
	require.Equal(t, []any{"dispatched", 1}, []any{status, attemptNo})

	_, err = env.Client.Resume(ctx, res.ID, engine.Repair{})
	require.NoError(t, err)
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.State("charged"), sg.State)
	require.Equal(t, 2, sg.Steps[0].Attempt, "attempt 1 died in its call; attempt 2 called again")
	require.True(t, sg.Steps[0].PossiblyDone)
	require.Equal(t, int32(2), calls.Load())
	require.Len(t, applied, 1, "one step key for both calls")
}

// TestDeadlineCancelsLikeCancel: a saga whose second step keeps failing
// passes its definition's deadline and is cancelled as Cancel does:
// the first step is compensated once, however many reapers race (the
// engine's own and eight passes at once), and the cancel is recorded as
// a repair by "deadline". While paused, the deadline waits.
func TestDeadlineCancelsLikeCancel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var undone atomic.Int32
	slow := saga.RetryPolicy{MaxAttempts: 50, InitialBackoff: 10 * time.Minute, MaxBackoff: 10 * time.Minute, Jitter: -1}
	def := saga.WithDeadline(saga.MustNew("late",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep,
			Forward:    func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { undone.Add(1); return nil, nil }},
		saga.Step{Name: "confirm", Reaches: "confirmed", Kind: saga.DatabaseStep, Retry: slow,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, errors.New("the partner is down")
			}},
	), 15*time.Minute)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	cl := env.Client
	res, err := cl.Start(ctx, def, "d-1", map[string]int{})
	require.NoError(t, err)
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.NotNil(t, sg.DeadlineAt)
	require.WithinDuration(t, sg.CreatedAt.Add(15*time.Minute), *sg.DeadlineAt, time.Millisecond)
	waitUntil(t, "confirm to wait for its retry", func() bool {
		status, _ := stepRow(t, env.Pool, res.ID, "confirm", saga.PhaseForward)
		return status == "retrying"
	})

	_, err = cl.Pause(ctx, res.ID, engine.Repair{Reason: "hold"})
	require.NoError(t, err)
	require.NoError(t, env.Clock.Advance(ctx, time.Hour)) // past the deadline, paused
	reapIdle(t, env.Engine)
	sg, err = cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("reserved"), sg.State, "the deadline waits while the saga is paused")

	_, err = cl.Resume(ctx, res.ID, engine.Repair{})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_, err := env.Engine.ReapOnce(ctx)
			require.NoError(t, err)
		})
	}
	wg.Wait()
	sg = env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "deadline of 15m0s passed")
	require.Equal(t, int32(1), undone.Load(), "the reservation was undone once")
	var n int
	var by, key string
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*), max(requested_by), max(request_key) from idemsaga.repairs where saga_id = $1 and operation = 'cancel'`,
		res.ID).Scan(&n, &by, &key))
	require.Equal(t, []any{1, "deadline", "idemsaga:deadline"}, []any{n, by, key})
	t.Logf("deadline passed while paused: held; resumed: cancelled once by 9 racing reapers, reservation undone 1x")
}

// TestReconcilePausesAndDeadlines: a paused saga's expired lease is not
// overdue; a resumed step nobody sent again, and a saga past its
// deadline that nobody cancelled, are reported.
func TestReconcilePausesAndDeadlines(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := saga.WithDeadline(saga.MustNew("nobody", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}), time.Minute)
	cl := brokerClient(t, pool, testenv.Name("RECPAUSE"), def)
	var ids []uuid.UUID
	for i := range 3 {
		res, err := cl.Start(ctx, def, fmt.Sprintf("k-%d", i), map[string]int{})
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	_, err := pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 hour'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.sagas set paused_at = now() where id = $1`, ids[0])
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set next_attempt_at = now() - interval '1 minute' where saga_id = $1`, ids[1])
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.sagas set deadline_at = now() - interval '1 hour' where id = $1`, ids[2])
	require.NoError(t, err)

	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{def}, time.Second)
	require.NoError(t, err)
	got := map[uuid.UUID][]string{}
	for _, d := range diffs {
		if d.SagaID != nil {
			got[*d.SagaID] = append(got[*d.SagaID], d.What)
		}
	}
	require.Empty(t, got[ids[0]], "a paused saga waits by design")
	require.Len(t, got[ids[1]], 1)
	require.Contains(t, got[ids[1]][0], "resumed, but its step in flight was not sent again")
	require.Len(t, got[ids[2]], 2)
	require.Contains(t, strings.Join(got[ids[2]], "\n"), "past its deadline and not cancelled")
}

// gauge reads one gauge of the family name for a definition (0 when the
// family has no such sample).
func gauge(t *testing.T, reg *prometheus.Registry, name, definition string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "definition" && lp.GetValue() == definition {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return 0
}

// TestResumeOutlivesItsWorkers: a saga paused before any worker ran it;
// the worker that receives its command holds it and stops; the resume is
// made by a client with no worker alive. The worker started next sends
// the held step again and the saga finishes at attempt 1.
func TestResumeOutlivesItsWorkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("RESUMEW")
	var calls atomic.Int32
	def := saga.MustNew("outlive", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { calls.Add(1); return nil, nil }})
	reg := prometheus.NewRegistry()
	first, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond, RelayHandOff: time.Second,
		Logger: quietLogger(), Registerer: reg})
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(ctx, engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream, LeaseGrace: 10 * time.Second}))
	cl := brokerClient(t, pool, stream, def)
	res, err := cl.Start(ctx, def, "o-1", map[string]int{})
	require.NoError(t, err)
	_, err = cl.Pause(ctx, res.ID, engine.Repair{Reason: "before anything ran"})
	require.NoError(t, err)

	require.NoError(t, first.Start(ctx))
	waitUntil(t, "the command held", func() bool { return metricSum(t, reg, "idemsaga_commands_held_total", nil) >= 1 })
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, first.Stop(sctx))

	_, err = cl.Resume(ctx, res.ID, engine.Repair{By: "test"}) // no worker alive
	require.NoError(t, err)
	status, attemptNo := stepRow(t, pool, res.ID, "s", saga.PhaseForward)
	require.Equal(t, []any{"dispatched", 1, int32(0)}, []any{status, attemptNo, calls.Load()})

	startEngine(t, pool, nc, stream, []*saga.Definition{def})
	wctx, cancelWait := context.WithTimeout(ctx, 30*time.Second)
	defer cancelWait()
	sg, err := cl.Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("done"), sg.State)
	require.Equal(t, 1, sg.Steps[0].Attempt)
	require.Equal(t, int32(1), calls.Load())
}

// TestDeadlineWaitsForACallInFlight: the deadline passes while an
// external call is in flight; the cancel waits for its outcome (an undo
// now could reach the other system before the call), then compensates
// it once.
func TestDeadlineWaitsForACallInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	var charged, refunded atomic.Int32
	long := saga.RetryPolicy{MaxAttempts: 50, InitialBackoff: 10 * time.Minute, MaxBackoff: 10 * time.Minute, Jitter: -1, Timeout: time.Minute}
	def := saga.WithDeadline(saga.MustNew("inflight",
		saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep, Retry: long,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				entered <- struct{}{}
				<-gate
				charged.Add(1)
				return nil, nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				if charged.Load() == 0 {
					return nil, errors.New("refund before the charge")
				}
				refunded.Add(1)
				return nil, nil
			}},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Retry: long,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, errors.New("no courier")
			}},
	), 10*time.Second)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	res, err := env.Client.Start(ctx, def, "i-1", map[string]int{})
	require.NoError(t, err)
	<-entered
	require.NoError(t, env.Clock.Advance(ctx, 20*time.Second)) // past the deadline, within the call's lease
	n, err := env.Engine.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "no cancel while the call is in flight")
	sg, err := env.Client.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateInit, sg.State)

	close(gate)
	sg = env.Wait(t, res.ID)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "deadline of 10s passed")
	require.Equal(t, []int32{1, 1}, []int32{charged.Load(), refunded.Load()})
}
