package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// heldDefinition is two database steps that do nothing: a saga of it
// completes at once unless something holds it.
func heldDefinition(t *testing.T) *saga.Definition {
	t.Helper()
	noop := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	def, err := saga.New("held",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: noop, Compensate: noop, Retry: fastPolicy},
		saga.Step{Name: "ship", Reaches: "shipped", Kind: saga.DatabaseStep, Forward: noop, Retry: fastPolicy},
	)
	require.NoError(t, err)
	return def
}

// inTx runs fn in a transaction of pool and commits it, or rolls it back
// when commit is false; fn's error is returned.
func inTx(t *testing.T, pool *pgxpool.Pool, commit bool, fn func(tx pgx.Tx) error) error {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(tx); err != nil {
		return err
	}
	if commit {
		require.NoError(t, tx.Commit(ctx))
	}
	return nil
}

func notes(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from notes`).Scan(&n))
	return n
}

// TestRepairsInTheCallersTransaction: a repair in a caller's transaction
// takes effect with its commit, not at all on its rollback, and one the
// saga's state refuses leaves the transaction usable.
func TestRepairsInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := heldDefinition(t)
	e := startEngine(t, pool, nc, testenv.Name("REPTX"), []*saga.Definition{def})
	cl := e.Client()
	_, err := pool.Exec(ctx, `create table notes (note text not null)`)
	require.NoError(t, err)
	note := func(tx pgx.Tx, s string) error {
		_, err := tx.Exec(ctx, `insert into notes values ($1)`, s)
		return err
	}

	// A start and its pause in one transaction: no step runs before the
	// resume.
	var started engine.StartResult
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		var err error
		if started, err = cl.StartTx(ctx, tx, def, "held-1", nil); err != nil {
			return err
		}
		res, err := cl.PauseTx(ctx, tx, started.ID, engine.Repair{Key: "pause-1", Reason: "held for review", By: "test"})
		require.Equal(t, saga.StateInit, res.State)
		return err
	}))
	sg, err := cl.Get(ctx, started.ID)
	require.NoError(t, err)
	require.NotNil(t, sg.Paused)
	require.Equal(t, saga.StateInit, sg.State)

	// A resume rolled back with the caller's own write: nothing changed,
	// and its key was not spent.
	require.NoError(t, inTx(t, pool, false, func(tx pgx.Tx) error {
		if _, err := cl.ResumeTx(ctx, tx, started.ID, engine.Repair{Key: "resume-1", By: "test"}); err != nil {
			return err
		}
		return note(tx, "resumed")
	}))
	sg, err = cl.Get(ctx, started.ID)
	require.NoError(t, err)
	require.NotNil(t, sg.Paused, "a rolled-back resume resumes nothing")
	require.Zero(t, notes(t, pool))

	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		res, err := cl.ResumeTx(ctx, tx, started.ID, engine.Repair{Key: "resume-1", By: "test"})
		require.False(t, res.Replayed, "the key of a resume rolled back is free")
		if err != nil {
			return err
		}
		return note(tx, "resumed")
	}))
	waitState(t, cl, started.ID, "shipped")
	require.Equal(t, 1, notes(t, pool))

	// Refused by the saga's state: the error says so, and the caller's
	// transaction goes on and commits its own write.
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		_, err := cl.CancelTx(ctx, tx, started.ID, engine.Repair{Reason: "too late"})
		require.ErrorIs(t, err, engine.ErrStateForbids)
		_, err = cl.RetryTx(ctx, tx, started.ID, engine.Repair{})
		require.ErrorIs(t, err, engine.ErrStateForbids)
		return note(tx, "after the refusals")
	}))
	require.Equal(t, 2, notes(t, pool))
	sg, err = cl.Get(ctx, started.ID)
	require.NoError(t, err)
	require.Len(t, sg.Repairs, 2, "the pause and the resume, not the refusals")

	// A definition's pause rolled back holds nothing; committed, it holds
	// a new saga; resumed, the saga runs.
	require.NoError(t, inTx(t, pool, false, func(tx pgx.Tx) error {
		_, err := cl.PauseDefinitionTx(ctx, tx, def.Name(), engine.Repair{Key: "def-pause"})
		return err
	}))
	paused, err := cl.PausedDefinitions(ctx)
	require.NoError(t, err)
	require.Empty(t, paused)
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		_, err := cl.PauseDefinitionTx(ctx, tx, def.Name(), engine.Repair{Key: "def-pause"})
		return err
	}))
	held, err := cl.Start(ctx, def, "held-2", nil)
	require.NoError(t, err)
	sg, err = cl.Get(ctx, held.ID)
	require.NoError(t, err)
	require.NotNil(t, sg.Paused)
	require.Equal(t, def.Name(), sg.Paused.Definition)
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		_, err := cl.ResumeDefinitionTx(ctx, tx, def.Name(), engine.Repair{Key: "def-resume"})
		return err
	}))
	waitState(t, cl, held.ID, "shipped")

	// A cancel in the transaction that starts the saga: the first step is
	// fenced before any worker took it, and nothing is left to undo.
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		res, err := cl.StartTx(ctx, tx, def, "held-3", nil)
		if err != nil {
			return err
		}
		if _, err := cl.PauseTx(ctx, tx, res.ID, engine.Repair{}); err != nil {
			return err
		}
		cancelled, err := cl.CancelTx(ctx, tx, res.ID, engine.Repair{Reason: "ordered by mistake"})
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, cancelled.State)
		started = res
		return err
	}))
	sg, err = cl.Get(ctx, started.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Equal(t, "cancelled by an operator: ordered by mistake", sg.Error)
}

// TestConcurrentPausesInCallersTransactions: sixteen transactions pause
// one saga at once, half under one request key and half under keys of
// their own. The saga's lock orders them: exactly one pause takes effect,
// every other request under its key is answered with it, and every other
// key is refused because the saga is paused already.
func TestConcurrentPausesInCallersTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := heldDefinition(t)
	e := startEngine(t, pool, nc, testenv.Name("REPTXC"), []*saga.Definition{def})
	cl := e.Client()
	require.NoError(t, cl.Check(ctx))
	// Held by its definition, so the pauses below race on a saga that
	// does not finish under them.
	_, err := cl.PauseDefinition(ctx, def.Name(), engine.Repair{})
	require.NoError(t, err)
	res, err := cl.Start(ctx, def, "contended", nil)
	require.NoError(t, err)

	const n = 16
	results := make([]engine.RepairResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		key := "same"
		if i%2 == 1 {
			key = fmt.Sprintf("own-%d", i)
		}
		wg.Go(func() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				errs[i] = err
				return
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if results[i], errs[i] = cl.PauseTx(ctx, tx, res.ID, engine.Repair{Key: key, Reason: "hold"}); errs[i] != nil {
				return
			}
			errs[i] = tx.Commit(ctx)
		})
	}
	wg.Wait()
	applied, replayed, refused := 0, 0, 0
	for i := range n {
		switch {
		case errs[i] == nil && results[i].Replayed:
			replayed++
			require.Equal(t, "same", results[i].Key)
		case errs[i] == nil:
			applied++
		default:
			require.ErrorIs(t, errs[i], engine.ErrStateForbids)
			refused++
		}
	}
	require.Equal(t, 1, applied, "one pause takes effect")
	require.Equal(t, n, applied+replayed+refused)
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Len(t, sg.Repairs, 1)
	if sg.Repairs[0].Key == "same" {
		require.Equal(t, n/2-1, replayed, "every other request under the winner's key is its replay")
	} else {
		require.Zero(t, replayed, "the same key's requests came after a pause of another key: refused")
	}
}

// TestCompleteInTheCallersTransaction: a callback delivered in the
// caller's transaction completes its step with the commit, and a rollback
// leaves the step waiting for the next delivery of the event.
func TestCompleteInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ch := newChannel()
	def := ch.definition(t, 0)
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	res, err := env.Client.Start(ctx, def, "order-tx", map[string]int{"amount": 5})
	require.NoError(t, err)
	token := ch.token(t)
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)
	cb := engine.Callback{Token: token, EventID: "txn-7", Result: json.RawMessage(`{"Txn":"txn-7"}`)}

	require.NoError(t, inTx(t, env.Pool, false, func(tx pgx.Tx) error {
		got, err := env.Client.CompleteTx(ctx, tx, cb)
		require.Equal(t, engine.CallbackApplied, got.Outcome)
		return err
	}))
	waitStatus(t, env, res.ID, "charge", saga.StepWaiting)

	require.NoError(t, inTx(t, env.Pool, true, func(tx pgx.Tx) error {
		got, err := env.Client.CompleteTx(ctx, tx, cb)
		require.False(t, got.Replayed, "the event of a rolled-back delivery was not recorded")
		return err
	}))
	sg := env.Wait(t, res.ID)
	require.Equal(t, saga.State("shipped"), sg.State)
	require.Len(t, sg.Callbacks, 1)

	again, err := env.Client.Complete(ctx, cb)
	require.NoError(t, err)
	require.True(t, again.Replayed)
}

// TestBulkInTheCallersTransaction: a bulk cancel in the caller's
// transaction cancels every saga it selected with the commit, none on a
// rollback, and reports a saga its state refuses without holding the
// others back.
func TestBulkInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := heldDefinition(t)
	e := startEngine(t, pool, nc, testenv.Name("BULKTX"), []*saga.Definition{def})
	cl := e.Client()
	_, err := cl.PauseDefinition(ctx, def.Name(), engine.Repair{})
	require.NoError(t, err)
	var ids []engine.StartResult
	for i := range 4 {
		res, err := cl.Start(ctx, def, fmt.Sprintf("bulk-%d", i), nil)
		require.NoError(t, err)
		ids = append(ids, res)
	}
	// One is cancelled already: the bulk cancel is refused for it alone.
	_, err = cl.Cancel(ctx, ids[0].ID, engine.Repair{})
	require.NoError(t, err)
	bulk := engine.BulkRepair{Operation: "cancel", Filter: engine.ListOptions{Definition: def.Name()}, Repair: engine.Repair{Key: "bulk-cancel", Reason: "recalled"}}

	require.NoError(t, inTx(t, pool, false, func(tx pgx.Tx) error {
		res, err := cl.BulkTx(ctx, tx, bulk)
		require.Len(t, res.Items, 4)
		return err
	}))
	for _, r := range ids[1:] {
		sg, err := cl.Get(ctx, r.ID)
		require.NoError(t, err)
		require.Equal(t, saga.StateInit, sg.State, "a bulk cancel rolled back cancels nothing")
	}

	var res engine.BulkResult
	require.NoError(t, inTx(t, pool, true, func(tx pgx.Tx) error {
		var err error
		res, err = cl.BulkTx(ctx, tx, bulk)
		return err
	}))
	refused := 0
	for _, it := range res.Items {
		if it.Err != nil {
			require.ErrorIs(t, it.Err, engine.ErrStateForbids)
			require.Equal(t, ids[0].ID, it.ID)
			refused++
			continue
		}
		require.False(t, it.Replayed, "the keys of the rolled-back bulk were not spent")
		require.Equal(t, saga.StateCompensated, it.State)
	}
	require.Equal(t, 1, refused)
	for _, r := range ids {
		sg, err := cl.Get(ctx, r.ID)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, sg.State)
	}
}
