package engine_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemsaga/idemsaga/internal/maintenance"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// fakeClock replaces the engine's clock, idemsaga.now(), in pool's
// database with the database's clock plus an offset, as the test kit
// does, and returns the function that moves the offset forward.
func fakeClock(t *testing.T, pool *pgxpool.Pool) func(time.Duration) {
	t.Helper()
	execSQL(t, pool, `create table public.fake_clock (offset_ms bigint not null);
insert into public.fake_clock values (0);
create or replace function idemsaga.now() returns timestamptz language sql stable parallel safe
as $$ select pg_catalog.now() + (select offset_ms from public.fake_clock) * interval '1 millisecond' $$`)
	return func(d time.Duration) {
		t.Helper()
		execSQL(t, pool, `update public.fake_clock set offset_ms = offset_ms + $1`, d.Milliseconds())
	}
}

// tokenEnv is a client of the transfer definition and of a second one,
// with the engine's clock faked.
type tokenEnv struct {
	pool    *pgxpool.Pool
	cl      *engine.Client
	def     *saga.Definition
	other   *saga.Definition
	advance func(time.Duration)
}

func newTokenEnv(t *testing.T) tokenEnv {
	t.Helper()
	pool := testenv.DB(t)
	advance := fakeClock(t, pool)
	def := transferDef(t)
	other := saga.MustNew("other", saga.Step{Name: "only", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def, other}, Logger: quietLogger()})
	require.NoError(t, err)
	return tokenEnv{pool: pool, cl: cl, def: def, other: other, advance: advance}
}

// written counts the sagas, steps and commands.
func (e tokenEnv) written(t *testing.T) []int64 {
	t.Helper()
	return []int64{
		countSQL(t, e.pool, `select count(*) from idemsaga.sagas`),
		countSQL(t, e.pool, `select count(*) from idemsaga.steps`),
		countSQL(t, e.pool, `select count(*) from idemsaga.outbox`),
	}
}

// TestSubmitTokenStart issues a token, starts a saga with it, and submits
// it again: the same input answers with the saga, another is refused.
func TestSubmitTokenStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)

	tok, err := e.cl.IssueToken(ctx, e.def, 0)
	require.NoError(t, err)
	require.True(t, engine.IsSubmitToken(tok.Token))
	require.Len(t, tok.Token, len(engine.SubmitTokenPrefix)+43)
	raw, err := base64.RawURLEncoding.DecodeString(tok.Token[len(engine.SubmitTokenPrefix):])
	require.NoError(t, err)
	require.Len(t, raw, 32)
	require.NoError(t, saga.CheckKey(tok.Token), "a token is a valid key everywhere")
	require.Equal(t, "transfer", tok.Definition)
	require.Equal(t, int64(1), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens
  where token = $1 and expires_at = $2 and expires_at - issued_at = interval '1 hour' and consumed_at is null`, tok.Token, tok.ExpiresAt))
	second, err := e.cl.IssueToken(ctx, e.def, 0)
	require.NoError(t, err)
	require.NotEqual(t, tok.Token, second.Token)

	first, err := e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.False(t, first.Duplicate)
	require.Equal(t, int64(1), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens
  where token = $1 and saga_id = $2 and consumed_at is not null`, tok.Token, first.ID))
	sg, err := e.cl.GetByKey(ctx, "transfer", tok.Token)
	require.NoError(t, err)
	require.Equal(t, first.ID, sg.ID)

	again, err := e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.Equal(t, engine.StartResult{ID: first.ID, State: saga.StateInit, Duplicate: true}, again)

	_, err = e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 11))
	require.ErrorIs(t, err, saga.ErrIdempotencyKeyReused)
	require.Equal(t, []int64{1, 1, 1}, e.written(t))

	// Past its expiry, the used token is still its saga's key.
	e.advance(2 * time.Hour)
	again, err = e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.Equal(t, first.ID, again.ID)

	// Its saga deleted (by retention, past the replay window, which may
	// come before the token's expiry), a used token starts nothing.
	e.advance(-2 * time.Hour)
	execSQL(t, e.pool, `delete from idemsaga.sagas where id = $1`, first.ID)
	_, err = e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 10))
	require.ErrorIs(t, err, engine.ErrSubmitTokenInvalid)
	require.ErrorContains(t, err, "was used already, by a saga since deleted")
	require.Zero(t, countSQL(t, e.pool, `select count(*) from idemsaga.sagas`))
}

// TestSubmitTokenRefused: a token never issued, one of another
// definition, an expired one and a key that only looks like a token
// start nothing, and say to fetch a new token.
func TestSubmitTokenRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	ofOther, err := e.cl.IssueToken(ctx, e.other, 0)
	require.NoError(t, err)
	expiring, err := e.cl.IssueToken(ctx, e.def, engine.MinSubmitTokenTTL)
	require.NoError(t, err)
	e.advance(engine.MinSubmitTokenTTL)

	cases := []struct {
		name, key, detail string
	}{
		{"never issued", engine.SubmitTokenPrefix + "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "was not issued"},
		{"looks like a token", "st_order-17", "was not issued"},
		{"another definition", ofOther.Token, "issued for a saga of other, not of transfer"},
		{"expired", expiring.Token, "expired at " + expiring.ExpiresAt.UTC().Format(time.RFC3339)},
	}
	for _, c := range cases {
		res, err := e.cl.Start(ctx, e.def, c.key, transferInput(1, 2, 10))
		require.ErrorIs(t, err, engine.ErrSubmitTokenInvalid, c.name)
		require.ErrorContains(t, err, c.detail, c.name)
		require.ErrorContains(t, err, "nothing was written: fetch a new token for transfer", c.name)
		require.Equal(t, engine.StartResult{}, res, c.name)
	}
	require.Equal(t, []int64{0, 0, 0}, e.written(t))
	require.Equal(t, int64(2), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens where consumed_at is null`))

	// The other definition's token still starts its own saga.
	_, err = e.cl.Start(ctx, e.other, ofOther.Token, map[string]any{})
	require.NoError(t, err)

	_, err = e.cl.IssueToken(ctx, e.def, engine.MinSubmitTokenTTL-time.Millisecond)
	require.ErrorContains(t, err, "outside 1m0s to 24h0m0s")
	_, err = e.cl.IssueToken(ctx, e.def, engine.MaxSubmitTokenTTL+time.Millisecond)
	require.ErrorContains(t, err, "outside 1m0s to 24h0m0s")
	_, err = e.cl.IssueToken(ctx, saga.MustNew("nobody", saga.Step{Name: "a", Reaches: "b", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}), 0)
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
	require.Equal(t, int64(2), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens`), "a refused issue writes nothing")
}

// TestSubmitTokenConsumedOnlyOnCommit: a start refused for its input, and
// one whose transaction rolls back, leave the token unused.
func TestSubmitTokenConsumedOnlyOnCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	tok, err := e.cl.IssueToken(ctx, e.def, 0)
	require.NoError(t, err)

	_, err = e.cl.Start(ctx, e.def, tok.Token, json.RawMessage(`{"from":1,"to":2,"amount":10,"Amount":7000}`))
	require.ErrorIs(t, err, saga.ErrInvalidInput)

	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	res, err := e.cl.StartTx(ctx, tx, e.def, tok.Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.False(t, res.Duplicate)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, []int64{0, 0, 0}, e.written(t))
	require.Equal(t, int64(1), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens where consumed_at is null`))

	// Issued in a transaction that rolls back, a token does not exist.
	tx, err = e.pool.Begin(ctx)
	require.NoError(t, err)
	gone, err := e.cl.IssueTokenTx(ctx, tx, e.def, 0)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	_, err = e.cl.Start(ctx, e.def, gone.Token, transferInput(1, 2, 10))
	require.ErrorIs(t, err, engine.ErrSubmitTokenInvalid)

	// The other input, with another amount, is a new submit: the token
	// was never used.
	res, err = e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 12))
	require.NoError(t, err)
	require.False(t, res.Duplicate)
	require.Equal(t, []int64{1, 1, 1}, e.written(t))
}

// TestSubmitTokenConcurrent starts one token 50 times at once, through
// the library (no HTTP lock): one saga, every other call a duplicate of
// it, none refused.
func TestSubmitTokenConcurrent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	tok, err := e.cl.IssueToken(ctx, e.def, 0)
	require.NoError(t, err)

	const n = 50
	results := make([]engine.StartResult, n)
	errs := make([]error, n)
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-gate
			results[i], errs[i] = e.cl.Start(ctx, e.def, tok.Token, transferInput(3, 4, 30))
		})
	}
	close(gate)
	wg.Wait()
	created := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, results[0].ID, results[i].ID)
		if !results[i].Duplicate {
			created++
		}
	}
	t.Logf("%d concurrent starts of one token: %d created, %d duplicates", n, created, n-created)
	require.Equal(t, 1, created)
	require.Equal(t, []int64{1, 1, 1}, e.written(t))
	require.Equal(t, int64(1), countSQL(t, e.pool, `select count(*) from idemsaga.submit_tokens where saga_id = $1`, results[0].ID))
}

// TestCleanerDeletesExpiredSubmitTokens: the cleaner deletes tokens past
// their expiry, used or not, and keeps live ones; a used token's saga
// still answers its resubmit.
func TestCleanerDeletesExpiredSubmitTokens(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	var short []engine.SubmitToken
	for range 5 {
		tok, err := e.cl.IssueToken(ctx, e.def, 10*time.Minute)
		require.NoError(t, err)
		short = append(short, tok)
	}
	long, err := e.cl.IssueToken(ctx, e.def, 2*time.Hour)
	require.NoError(t, err)
	used, err := e.cl.Start(ctx, e.def, short[0].Token, transferInput(1, 2, 10))
	require.NoError(t, err)

	c := newCleaner(t, e.pool, engine.RetentionConfig{BatchSize: 2})
	res, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanResult{}, res, "nothing expired yet")

	e.advance(10*time.Minute + time.Millisecond)
	res, err = c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanResult{SubmitTokens: 5, Batches: 3}, res)
	require.Equal(t, []string{long.Token}, submitTokens(t, e.pool))

	again, err := e.cl.Start(ctx, e.def, short[0].Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.Equal(t, engine.StartResult{ID: used.ID, State: saga.StateInit, Duplicate: true}, again)
	_, err = e.cl.Start(ctx, e.def, short[1].Token, transferInput(1, 2, 10))
	require.ErrorIs(t, err, engine.ErrSubmitTokenInvalid)
	require.Equal(t, []int64{1, 1, 1}, e.written(t))
}

func submitTokens(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	var toks []string
	rows, err := pool.Query(context.Background(), `select token from idemsaga.submit_tokens order by token`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		toks = append(toks, s)
	}
	require.NoError(t, rows.Err())
	return toks
}

// TestSubmitTokenWaitsForTheFirst: a start of a token another
// transaction is consuming waits for it; it answers with that saga once
// the first commits, and starts the saga itself if the first rolls back.
func TestSubmitTokenWaitsForTheFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	for _, commit := range []bool{true, false} {
		tok, err := e.cl.IssueToken(ctx, e.def, 0)
		require.NoError(t, err)
		tx, err := e.pool.Begin(ctx)
		require.NoError(t, err)
		first, err := e.cl.StartTx(ctx, tx, e.def, tok.Token, transferInput(5, 6, 50))
		require.NoError(t, err)

		type answer struct {
			res engine.StartResult
			err error
		}
		done := make(chan answer, 1)
		go func() {
			res, err := e.cl.Start(ctx, e.def, tok.Token, transferInput(5, 6, 50))
			done <- answer{res, err}
		}()
		testenv.WaitForLockWaiters(t, e.pool, 1)
		if commit {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
		a := <-done
		require.NoError(t, a.err, "commit %v", commit)
		require.Equal(t, commit, a.res.Duplicate, "commit %v", commit)
		if commit {
			require.Equal(t, first.ID, a.res.ID)
		}
		require.Equal(t, int64(1), countSQL(t, e.pool, `select count(*) from idemsaga.sagas where idem_key = $1 and id = $2`, tok.Token, a.res.ID))
	}
}

// TestReconcileSubmitTokens: a token and the saga it started agree; a
// token that names no saga of its key, or another one, is reported.
func TestReconcileSubmitTokens(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTokenEnv(t)
	tokenDiffs := func() []string {
		t.Helper()
		diffs, err := engine.Reconcile(ctx, e.pool, []*saga.Definition{e.def, e.other}, 0)
		require.NoError(t, err)
		var out []string
		for _, d := range diffs {
			if strings.Contains(d.What, "submit token") {
				out = append(out, d.String())
			}
		}
		return out
	}
	tok, err := e.cl.IssueToken(ctx, e.def, 0)
	require.NoError(t, err)
	_, err = e.cl.IssueToken(ctx, e.def, 0) // unused, and no saga: fine
	require.NoError(t, err)
	res, err := e.cl.Start(ctx, e.def, tok.Token, transferInput(1, 2, 10))
	require.NoError(t, err)
	require.Empty(t, tokenDiffs())

	execSQL(t, e.pool, `update idemsaga.submit_tokens set saga_id = null, consumed_at = null where token = $1`, tok.Token)
	require.Equal(t, []string{"saga " + res.ID.String() + ": started with submit token " + tok.Token + ", which is recorded as unused"}, tokenDiffs())
}
