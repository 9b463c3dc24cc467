package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestStartSameKeyConcurrently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)

	const n = 50
	var wg sync.WaitGroup
	results := make([]engine.StartResult, n)
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = cl.Start(ctx, def, "same-key", transferInput(1, 2, 10))
		})
	}
	close(start)
	wg.Wait()

	created := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, results[0].ID, results[i].ID, "every caller gets the same saga")
		if !results[i].Duplicate {
			created++
		}
	}
	require.Equal(t, 1, created, "exactly one call creates the saga; the rest are duplicates")
	var sagas, steps, outbox int
	require.NoError(t, pool.QueryRow(ctx, `select (select count(*) from idemsaga.sagas), (select count(*) from idemsaga.steps), (select count(*) from idemsaga.outbox)`).Scan(&sagas, &steps, &outbox))
	require.Equal(t, []int{1, 1, 1}, []int{sagas, steps, outbox}, "one saga, one dispatched step, one command")
}

func TestStartKeyReusedWithDifferentInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)

	first, err := cl.Start(ctx, def, "k", transferInput(1, 2, 10))
	require.NoError(t, err)
	require.False(t, first.Duplicate)

	// The same input written differently is the same intent.
	again, err := cl.Start(ctx, def, "k", []byte(`{"amount": 10, "to": 2, "from": 1}`))
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, first.ID, again.ID)

	snapshot := func() [3]int {
		var s [3]int
		require.NoError(t, pool.QueryRow(ctx, `select (select count(*) from idemsaga.sagas), (select count(*) from idemsaga.steps), (select count(*) from idemsaga.outbox)`).Scan(&s[0], &s[1], &s[2]))
		return s
	}
	before := snapshot()
	_, err = cl.Start(ctx, def, "k", transferInput(1, 2, 11))
	require.ErrorIs(t, err, saga.ErrIdempotencyKeyReused)
	require.Contains(t, err.Error(), "new key")
	require.Equal(t, before, snapshot(), "a rejected start writes nothing")

	// Racing starts with two different inputs: one saga, one input wins,
	// every loser is told the key is taken.
	const n = 40
	var wg sync.WaitGroup
	errs := make([]error, n)
	gate := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-gate
			_, errs[i] = cl.Start(ctx, def, "race", transferInput(1, 2, int64(100+i%2)))
		})
	}
	close(gate)
	wg.Wait()
	var winners, reused [2]int
	for i, err := range errs {
		switch {
		case err == nil:
			winners[i%2]++
		case errors.Is(err, saga.ErrIdempotencyKeyReused):
			reused[i%2]++
		default:
			t.Fatalf("unexpected error: %v", err)
		}
	}
	require.True(t, (winners[0] == n/2 && reused[1] == n/2) || (winners[1] == n/2 && reused[0] == n/2),
		"all callers with the winning input succeed, all others are rejected: winners %v reused %v", winners, reused)
	var sagas int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where idem_key = 'race'`).Scan(&sagas))
	require.Equal(t, 1, sagas)
}

func TestStartBadInputWritesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)

	_, err = cl.Start(ctx, def, "", transferInput(1, 2, 1))
	require.ErrorIs(t, err, saga.ErrInvalidKey)
	require.ErrorContains(t, err, "it is empty")
	_, err = cl.Start(ctx, def, "k", []byte(`{not json`))
	require.ErrorContains(t, err, "not valid JSON")
	other := saga.MustNew("other", saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "done", Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	_, err = cl.Start(ctx, other, "k", map[string]int{})
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
	// Smuggled members: what a gateway checking "amount" would not see.
	for _, body := range []string{`{"from":1,"to":2,"amount":5,"AMOUNT":7000}`, `{"from":1,"to":2,"amount":5,"amount":7000}`} {
		_, err = cl.Start(ctx, def, "k", []byte(body))
		require.ErrorIs(t, err, saga.ErrInvalidInput, body)
		_, err = cl.Start(ctx, def, "k", json.RawMessage(body))
		require.ErrorIs(t, err, saga.ErrInvalidInput, body)
	}
	_, err = cl.Start(ctx, def, " k", transferInput(1, 2, 1))
	require.ErrorIs(t, err, saga.ErrInvalidKey, "a key with a surrounding space is refused, not trimmed")
	var sagas int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas`).Scan(&sagas))
	require.Zero(t, sagas)
}

func TestStartTxFollowsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{fixture.Default}})
	require.NoError(t, err)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	rolled, err := cl.StartTx(ctx, tx, fixture.Default, "rolled-back", transferInput(1, 2, 3))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	_, err = cl.Get(ctx, rolled.ID)
	require.ErrorIs(t, err, saga.ErrNotFound)

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `insert into fixture.accounts (id, balance) values (77, 5)`)
	require.NoError(t, err)
	kept, err := cl.StartTx(ctx, tx, fixture.Default, "committed", transferInput(77, 2, 3))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	sg, err := cl.Get(ctx, kept.ID)
	require.NoError(t, err)
	require.Equal(t, "committed", sg.Key)
	require.Len(t, sg.Steps, 1)
	require.Equal(t, saga.StepKey(kept.ID, fixture.StepDeduct, saga.PhaseForward), sg.Steps[0].Key)
}

// TestADuplicateStartIsOneRoundTrip: a start under a key whose saga
// committed before it is answered by the start statement itself, whether
// the input matches (a duplicate) or not (the key is reused).
func TestADuplicateStartIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	pool, counted := testenv.CountRoundTrips(t, shared)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)

	first, err := cl.Start(ctx, def, "k", transferInput(1, 2, 10))
	require.NoError(t, err)
	require.False(t, first.Duplicate)

	counted.Reset()
	again, err := cl.Start(ctx, def, "k", transferInput(1, 2, 10))
	require.NoError(t, err)
	require.Equal(t, engine.StartResult{ID: first.ID, State: saga.StateInit, Duplicate: true}, again)
	require.Equal(t, []int32{0, 1}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone: %q", counted.SentAlone())

	counted.Reset()
	reused, err := cl.Start(ctx, def, "k", transferInput(1, 2, 11))
	require.ErrorIs(t, err, saga.ErrIdempotencyKeyReused)
	require.Equal(t, first.ID, reused.ID)
	require.Equal(t, []int32{0, 1}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone: %q", counted.SentAlone())
}

// TestADuplicateStartThatWaitedReadsTheSagaAfter: a start whose insert
// waited for the commit of another start of its key cannot see that saga
// in its own snapshot; it reads it after, and answers as for any other
// duplicate or reused key.
func TestADuplicateStartThatWaitedReadsTheSagaAfter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	pool, counted := testenv.CountRoundTrips(t, shared)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)
	first, err := engine.NewClient(engine.Config{Pool: shared, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)
	require.NoError(t, cl.Check(ctx), "the one-time check of the deployment is not what this test counts")
	require.NoError(t, first.Check(ctx))

	tx, err := shared.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	won, err := first.StartTx(ctx, tx, def, "k", transferInput(1, 2, 10))
	require.NoError(t, err)

	counted.Reset()
	var (
		wg                sync.WaitGroup
		same, other       engine.StartResult
		errSame, errOther error
	)
	wg.Go(func() { same, errSame = cl.Start(ctx, def, "k", transferInput(1, 2, 10)) })
	wg.Go(func() { other, errOther = cl.Start(ctx, def, "k", transferInput(1, 2, 11)) })
	testenv.WaitForLockWaiters(t, shared, 2)
	require.NoError(t, tx.Commit(ctx))
	wg.Wait()

	require.NoError(t, errSame)
	require.Equal(t, engine.StartResult{ID: won.ID, State: saga.StateInit, Duplicate: true}, same)
	require.ErrorIs(t, errOther, saga.ErrIdempotencyKeyReused)
	require.Equal(t, won.ID, other.ID)
	// Each: the start statement, then the read of the saga it waited for.
	require.Equal(t, []int32{0, 4}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone: %q", counted.SentAlone())
}

// TestStartTxAtSerializableWithOtherKeys: two SERIALIZABLE transactions
// that start sagas under different keys, interleaved, both commit; the
// start's look for an existing saga must not make them conflict (it reads
// only when its insert found the key taken).
func TestStartTxAtSerializableWithOtherKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(t, err)

	var txs [2]pgx.Tx
	for i := range txs {
		txs[i], err = pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		require.NoError(t, err)
		defer func() { _ = txs[i].Rollback(ctx) }()
	}
	for i, tx := range txs {
		res, err := cl.StartTx(ctx, tx, def, fmt.Sprintf("serializable-%d", i), transferInput(1, 2, 10))
		require.NoError(t, err)
		require.False(t, res.Duplicate)
	}
	for i, tx := range txs {
		require.NoError(t, tx.Commit(ctx), "commit of transaction %d", i)
	}
	var n int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where idem_key like 'serializable-%'`).Scan(&n))
	require.Equal(t, 2, n)
}
