package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
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

// everyState is a saga that can be brought to each state an operator
// meets, by its input's mode: a database step (a, whose undo fails for
// good in mode "failed"), an external step without a compensation (b:
// held in flight, retried after an hour, given up as possibly done, or
// refused), and a callback step (c), answered as soon as it waits or
// never.
type everyState struct {
	mu      sync.Mutex
	entered map[uuid.UUID]chan struct{}
	release map[uuid.UUID]chan struct{}
	// calls counts b's calls, per saga.
	calls map[uuid.UUID]int
}

func (e *everyState) called(id uuid.UUID) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls[id]
}

type modeInput struct {
	Mode string `json:"mode"`
}

func (e *everyState) gate(id uuid.UUID) (entered, release chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.entered[id] == nil {
		e.entered[id], e.release[id] = make(chan struct{}), make(chan struct{})
	}
	return e.entered[id], e.release[id]
}

func (e *everyState) definition() *saga.Definition {
	mode := func(sc *saga.StepContext) string {
		var in modeInput
		_ = json.Unmarshal(sc.Input, &in)
		return in.Mode
	}
	return saga.MustNew("everystate",
		saga.Step{Name: "a", Reaches: "a-done", Kind: saga.DatabaseStep,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id, step) values ($1, 'a')`, sc.SagaID)
				return nil, err
			},
			Compensate: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				if mode(sc) == "failed" {
					return nil, saga.Permanent(errors.New("the undo is refused"))
				}
				_, err := sc.Tx.Exec(ctx, `delete from effects where saga_id = $1 and step = 'a'`, sc.SagaID)
				return nil, err
			}},
		saga.Step{Name: "b", Reaches: "b-done", Kind: saga.ExternalStep,
			Retry: saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Hour, MaxBackoff: time.Hour, Jitter: -1, Timeout: time.Minute},
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				e.mu.Lock()
				e.calls[sc.SagaID]++
				e.mu.Unlock()
				switch mode(sc) {
				case "block":
					entered, release := e.gate(sc.SagaID)
					select {
					case <-entered:
					default:
						close(entered)
					}
					select {
					case <-release:
					case <-ctx.Done():
						return nil, ctx.Err()
					}
				case "retry":
					if sc.Attempt == 1 {
						return nil, saga.NotApplied(errors.New("busy: nothing charged"))
					}
				case "park":
					return nil, errors.New("no answer")
				case "refuse", "failed":
					return nil, saga.Permanent(errors.New("declined"))
				}
				return json.RawMessage(`{"b":1}`), nil
			}},
		saga.Step{Name: "c", Reaches: "c-done", Kind: saga.CallbackStep, Wait: time.Hour,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return json.RawMessage(`{"accepted":true}`), nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
	)
}

// TestEveryRepairOnEveryState puts a saga in each state an operator
// meets (running with its step dispatched, retrying or waiting for a
// callback; paused; parked; failed; compensated; completed; closed),
// applies each repair to it, lets it run to its end (its callback
// answered, or its wait run out), and delivers each forward step's last
// command once more, late. Every repair either is refused with a
// clear error and changes nothing, or leaves a saga that reconcile finds
// clean (a parked or failed one is listed for a person, nothing else).
func TestEveryRepairOnEveryState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	es := &everyState{entered: map[uuid.UUID]chan struct{}{}, release: map[uuid.UUID]chan struct{}{}, calls: map[uuid.UUID]int{}}
	def := es.definition()
	// 144 sagas at once, each waited for: on a loaded machine (the suite's
	// other packages beside it) their steps queue behind one another for
	// longer than the kit's default bound.
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}, Timeout: 3 * time.Minute, Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `create table effects (saga_id uuid not null, step text not null, primary key (saga_id, step))`)
		return err
	}})
	stepStatus := func(id uuid.UUID, step string) string {
		var status string
		_ = env.Pool.QueryRow(ctx, `select status from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'`, id, step).Scan(&status)
		return status
	}
	untilStep := func(id uuid.UUID, step, status string) {
		require.Eventually(t, func() bool { return stepStatus(id, step) == status }, 3*time.Minute, 5*time.Millisecond, "step %s %s", step, status)
	}
	start := func(key, mode string) uuid.UUID {
		res, err := env.Client.Start(ctx, def, key, modeInput{Mode: mode})
		require.NoError(t, err)
		return res.ID
	}
	completeC := func(id uuid.UUID) {
		_, err := env.Client.Complete(ctx, engine.Callback{Token: saga.CallbackToken(id, "c"), EventID: "ev-" + id.String(), Result: json.RawMessage(`{"c":1}`)})
		require.NoError(t, err)
	}
	states := []struct {
		name string
		// make brings a new saga to the state and returns the step an
		// operator would name.
		make func(key string) (uuid.UUID, string)
	}{
		{"dispatched", func(key string) (uuid.UUID, string) {
			id := start(key, "block")
			entered, _ := es.gate(id)
			<-entered
			return id, "b"
		}},
		{"retrying", func(key string) (uuid.UUID, string) {
			id := start(key, "retry")
			untilStep(id, "b", "retrying")
			return id, "b"
		}},
		{"waiting", func(key string) (uuid.UUID, string) {
			id := start(key, "ok")
			untilStep(id, "c", "waiting")
			return id, "c"
		}},
		{"paused", func(key string) (uuid.UUID, string) {
			id := start(key, "retry")
			untilStep(id, "b", "retrying")
			_, err := env.Client.Pause(ctx, id, engine.Repair{Reason: "hold it"})
			require.NoError(t, err)
			return id, "b"
		}},
		{"parked", func(key string) (uuid.UUID, string) {
			id := start(key, "park")
			require.Equal(t, saga.StateParked, env.Wait(t, id).State)
			return id, "b"
		}},
		{"failed", func(key string) (uuid.UUID, string) {
			id := start(key, "failed")
			require.Equal(t, saga.StateFailed, env.Wait(t, id).State)
			return id, "a"
		}},
		{"compensated", func(key string) (uuid.UUID, string) {
			id := start(key, "refuse")
			require.Equal(t, saga.StateCompensated, env.Wait(t, id).State)
			return id, "b"
		}},
		{"completed", func(key string) (uuid.UUID, string) {
			id := start(key, "ok")
			untilStep(id, "c", "waiting")
			completeC(id)
			require.Equal(t, saga.State("c-done"), env.Wait(t, id).State)
			return id, "c"
		}},
		{"closed", func(key string) (uuid.UUID, string) {
			id := start(key, "park")
			require.Equal(t, saga.StateParked, env.Wait(t, id).State)
			_, err := env.Client.Close(ctx, id, engine.Repair{Reason: "handled by hand"})
			require.NoError(t, err)
			return id, "b"
		}},
	}
	repairs := []struct {
		name  string
		apply func(id uuid.UUID, step string) (engine.RepairResult, error)
		// alone: the repair holds every saga of the definition, so its
		// cases run one at a time, after the others.
		alone bool
	}{
		{"retry", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			return env.Client.Retry(ctx, id, engine.Repair{Reason: "table"})
		}, false},
		{"cancel", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			return env.Client.Cancel(ctx, id, engine.Repair{Reason: "table"})
		}, false},
		{"skip", func(id uuid.UUID, step string) (engine.RepairResult, error) {
			return env.Client.Skip(ctx, id, engine.SkipStep{Step: step, Result: json.RawMessage(`{"skipped":true}`)}, engine.Repair{Reason: "table"})
		}, false},
		{"close", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			return env.Client.Close(ctx, id, engine.Repair{Reason: "table"})
		}, false},
		{"pause", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			return env.Client.Pause(ctx, id, engine.Repair{Reason: "table"})
		}, false},
		{"resume", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			return env.Client.Resume(ctx, id, engine.Repair{Reason: "table"})
		}, false},
		// The saga's deadline passes: the engine cancels it, as a repair
		// by "deadline", when it can.
		{"deadline", func(id uuid.UUID, _ string) (engine.RepairResult, error) {
			_, err := env.Pool.Exec(ctx, `update idemsaga.sagas set deadline_at = idemsaga.now() where id = $1 and finished_at is null`, id)
			return engine.RepairResult{}, err
		}, false},
		{"pause-definition", func(uuid.UUID, string) (engine.RepairResult, error) {
			_, err := env.Client.PauseDefinition(ctx, def.Name(), engine.Repair{Reason: "table"})
			return engine.RepairResult{}, err
		}, true},
	}

	type outcome struct{ before, after, result string }
	cases := map[uuid.UUID]string{}
	results := map[string]outcome{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var alone []func()
	for _, st := range states {
		for _, rp := range repairs {
			for _, ending := range []string{"answered", "unanswered"} {
				name := st.name + "/" + rp.name + "/" + ending
				run := func() {
					id, step := st.make(strings.ReplaceAll(name, "/", "-"))
					before, err := env.Client.Get(ctx, id)
					require.NoError(t, err)
					_, rerr := rp.apply(id, step)
					o := outcome{before: string(before.State)}
					if rerr != nil {
						// A refusal is clear and changes nothing.
						require.True(t, errors.Is(rerr, engine.ErrStateForbids) || errors.Is(rerr, engine.ErrStepInFlight), "%s: %v", name, rerr)
						same, err := env.Client.Get(ctx, id)
						require.NoError(t, err)
						require.Equal(t, []any{before.State, before.Version}, []any{same.State, same.Version}, "%s refused (%v) but the saga changed", name, rerr)
						o.result = "refused"
					} else {
						o.result = "applied"
					}
					// Let it run to its end: release a held call, answer a
					// callback, resume a pause; then a late copy of the step's
					// command, as a slow delivery would bring it.
					if _, release := es.gate(id); st.name == "dispatched" {
						close(release)
					}
					if rp.alone && rerr == nil {
						_, err := env.Client.ResumeDefinition(ctx, def.Name(), engine.Repair{Reason: "table: let it end"})
						require.NoError(t, err)
					}
					if sg, err := env.Client.Get(ctx, id); err == nil && sg.Paused != nil && sg.Paused.Definition == "" {
						_, err := env.Client.Resume(ctx, id, engine.Repair{Reason: "table: let it end"})
						require.NoError(t, err)
					}
					// The callback step is answered as soon as it waits, or
					// never: its wait runs out and it is given up.
					stop := make(chan struct{})
					answered := make(chan struct{})
					go func() {
						defer close(answered)
						for ending == "answered" {
							if stepStatus(id, "c") == "waiting" {
								completeC(id)
								return
							}
							select {
							case <-stop:
								return
							case <-time.After(5 * time.Millisecond):
							}
						}
					}()
					end := env.Wait(t, id)
					close(stop)
					<-answered
					o.after = string(end.State)
					mu.Lock()
					cases[id] = name
					results[name] = o
					mu.Unlock()
				}
				if rp.alone {
					alone = append(alone, run)
				} else {
					wg.Go(run)
				}
			}
		}
	}
	wg.Wait()
	for _, run := range alone {
		run()
	}

	// A late copy of each forward step's last attempt, to a worker that
	// remembers nothing: answered from what the step's key holds, without
	// a call or a write of effect.
	late := newReplyWorker(t, env.Pool, "sagatest", 0, def)
	for id, name := range cases {
		sg, err := env.Client.Get(ctx, id)
		require.NoError(t, err)
		calls := es.called(id)
		for _, st := range sg.Steps {
			if st.Phase != saga.PhaseForward || st.Step == "c" {
				continue
			}
			r, err := late.Handle(ctx, wire.Command{SagaID: id, Definition: def.Name(), Step: st.Step, Phase: saga.PhaseForward,
				Key: saga.StepKey(id, st.Step, saga.PhaseForward), Attempt: st.Attempt, Input: sg.Input})
			require.NoError(t, err, "%s: a late %s", name, st.Step)
			require.True(t, r.Duplicate, "%s: a late copy of %s's attempt %d is answered as a duplicate (%s %s)", name, st.Step, st.Attempt, r.Outcome, r.Error)
		}
		require.Equal(t, calls, es.called(id), "%s: a late copy called b again", name)
		after, err := env.Client.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, []any{sg.State, sg.Version}, []any{after.State, after.Version}, "%s: a late copy moved the saga", name)
	}
	// The business agrees: a compensated saga's write is undone (unless an
	// operator's skip said it was undone by hand), a completed one's is
	// there, once.
	var undoneKept, doneMissing int
	require.NoError(t, env.Pool.QueryRow(ctx, `select
  count(*) filter (where s.state = 'compensated' and e.saga_id is not null and not exists (
    select 1 from idemsaga.repairs r where r.saga_id = s.id and r.operation = 'skip' and r.phase = 'compensate')),
  count(*) filter (where s.state = 'c-done' and e.saga_id is null)
from idemsaga.sagas s left join effects e on e.saga_id = s.id`).Scan(&undoneKept, &doneMissing))
	require.Equal(t, []int{0, 0}, []int{undoneKept, doneMissing}, "compensated sagas that kept their write, completed ones without it")

	diffs, err := engine.Reconcile(ctx, env.Pool, []*saga.Definition{def}, 1000*time.Hour)
	require.NoError(t, err)
	var wrong []string
	for _, d := range diffs {
		if strings.HasPrefix(d.What, "parked and needs a person") || strings.HasPrefix(d.What, "failed and needs a person") {
			continue
		}
		name := "(no saga)"
		if d.SagaID != nil {
			name = cases[*d.SagaID]
		}
		wrong = append(wrong, fmt.Sprintf("%s: %s", name, d.What))
	}
	var table []string
	for name, o := range results {
		table = append(table, fmt.Sprintf("%-24s %-12s %-8s -> %s", name, o.before, o.result, o.after))
	}
	slices.Sort(table)
	t.Logf("%d states x %d repairs x 2 endings:\n%s", len(states), len(repairs), strings.Join(table, "\n"))
	require.Len(t, results, 2*len(states)*len(repairs))
	require.Empty(t, wrong, "repairs that left a state reconcile calls a difference")
}
