package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestResultBound: a handler's result over Config.MaxResultBytes fails
// its attempt, whatever runs at once. A database step's writes are rolled
// back with it and it fails for good: the saga compensates the steps
// before it, and the step's own effect never was. An external step's call
// may have taken effect: its attempts count as unknown, so once they run
// out it is possibly done and its compensation runs. A skip's or a
// callback's result over the bound is refused and nothing is written.
func TestResultBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("BOUND")
	_, err := pool.Exec(ctx, `create table bound_ledger (saga_id uuid, step text, phase text)`)
	require.NoError(t, err)
	type in struct {
		BigNote bool `json:"big_note,omitempty"`
		BigCall bool `json:"big_call,omitempty"`
	}
	big := json.RawMessage(`{"blob":"` + strings.Repeat("x", 200) + `"}`)
	var mu sync.Mutex
	calls, undone := map[uuid.UUID]int{}, map[uuid.UUID]int{}
	write := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		_, err := sc.Tx.Exec(ctx, `insert into bound_ledger values ($1, $2, $3)`, sc.SagaID, sc.Step, string(sc.Phase))
		return nil, err
	}
	policy := fastPolicy
	policy.MaxAttempts = 2
	def := saga.MustNew("bound",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: write, Compensate: write, Retry: policy, CompensateRetry: policy},
		saga.Step{Name: "note", Reaches: "noted", Kind: saga.DatabaseStep, Retry: policy, CompensateRetry: policy, Compensate: write,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				var v in
				if err := sc.DecodeInput(&v); err != nil {
					return nil, err
				}
				if _, err := write(ctx, sc); err != nil {
					return nil, err
				}
				if v.BigNote {
					return big, nil
				}
				return json.RawMessage(`{"ok":true}`), nil
			}},
		saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep, Retry: policy, CompensateRetry: policy,
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				var v in
				if err := sc.DecodeInput(&v); err != nil {
					return nil, err
				}
				mu.Lock()
				calls[sc.SagaID]++
				mu.Unlock()
				if v.BigCall {
					return big, nil
				}
				return json.RawMessage(`{"ok":true}`), nil
			},
			Compensate: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				mu.Lock()
				undone[sc.SagaID]++
				mu.Unlock()
				return nil, nil
			}},
	)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.MaxResultBytes = 100 })
	cl := e.Client()

	const n = 6
	kinds := []in{{BigNote: true}, {BigCall: true}, {}}
	ids := make([][]uuid.UUID, len(kinds))
	var wg sync.WaitGroup
	for k, v := range kinds {
		ids[k] = make([]uuid.UUID, n)
		for i := range n {
			wg.Go(func() {
				res, err := cl.Start(ctx, def, fmt.Sprintf("bound-%d-%d", k, i), v)
				require.NoError(t, err)
				ids[k][i] = res.ID
			})
		}
	}
	wg.Wait()
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	ledger := func(id uuid.UUID) []string {
		rows, err := pool.Query(ctx, `select step || ':' || phase from bound_ledger where saga_id = $1 order by step, phase`, id)
		require.NoError(t, err)
		var out []string
		for rows.Next() {
			var s string
			require.NoError(t, rows.Scan(&s))
			out = append(out, s)
		}
		require.NoError(t, rows.Err())
		return out
	}
	stepOf := func(sg *saga.Instance, name string) saga.StepExecution {
		for _, s := range sg.Steps {
			if s.Step == name && s.Phase == saga.PhaseForward {
				return s
			}
		}
		t.Fatalf("saga %s has no forward step %s", sg.ID, name)
		return saga.StepExecution{}
	}
	for i := range n {
		// A database step over the bound: rolled back, failed for good.
		sg, err := cl.Wait(wctx, ids[0][i])
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, sg.State)
		note := stepOf(sg, "note")
		require.Equal(t, 1, note.Attempt, "failed for good at its first attempt")
		require.Contains(t, note.LastError, "over the 100-byte bound (Config.MaxResultBytes)")
		require.False(t, note.PossiblyDone)
		require.Equal(t, []string{"reserve:compensate", "reserve:forward"}, ledger(sg.ID), "the note's row was rolled back")
		mu.Lock()
		require.Zero(t, calls[sg.ID], "nothing after it ran")
		mu.Unlock()

		// An external step over the bound: possibly done, compensated.
		sg, err = cl.Wait(wctx, ids[1][i])
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, sg.State)
		call := stepOf(sg, "call")
		require.True(t, call.PossiblyDone, "its call may have taken effect")
		require.Contains(t, call.LastError, "over the 100-byte bound")
		mu.Lock()
		require.Equal(t, policy.MaxAttempts, calls[sg.ID], "tried again under its key until its attempts ran out")
		require.Equal(t, 1, undone[sg.ID], "compensated once")
		mu.Unlock()

		// Within the bound: completed.
		sg, err = cl.Wait(wctx, ids[2][i])
		require.NoError(t, err)
		require.Equal(t, saga.State("called"), sg.State)
	}

	// A skip's and a callback's result over the bound: refused, nothing
	// written.
	repairs := countRows(t, ctx, pool, `select count(*) from idemsaga.repairs`)
	_, err = cl.Skip(ctx, ids[0][0], engine.SkipStep{Step: "note", Result: big}, engine.Repair{Key: "skip-big", Reason: "too big"})
	require.ErrorIs(t, err, engine.ErrResultTooLarge)
	require.ErrorContains(t, err, "bytes, over the 100-byte bound")
	_, err = cl.Complete(ctx, engine.Callback{Token: saga.CallbackToken(ids[2][0], "call"), EventID: "e-1", Result: big})
	require.ErrorIs(t, err, engine.ErrResultTooLarge)
	require.Equal(t, repairs, countRows(t, ctx, pool, `select count(*) from idemsaga.repairs`))
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.callbacks`))
}
