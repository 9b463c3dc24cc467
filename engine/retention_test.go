package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemsaga/idemsaga/internal/maintenance"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// Time passes by backdating rows: every timestamp the cleaner reads is set
// to now() minus an interval, and the cleaner compares with now() too.

func newCleaner(t *testing.T, pool *pgxpool.Pool, cfg engine.RetentionConfig) *maintenance.Cleaner {
	t.Helper()
	c, err := engine.NewCleaner(pool, cfg, quietLogger())
	require.NoError(t, err)
	return c
}

func execSQL(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	tag, err := pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err, sql)
	return tag.RowsAffected()
}

func countSQL(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n), sql)
	return n
}

// rowsJSON returns the rows of query as JSON text, sorted.
func rowsJSON(t *testing.T, pool *pgxpool.Pool, query string, args ...any) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select row_to_json(x)::text from (`+query+`) x order by 1`, args...)
	require.NoError(t, err)
	texts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err, query)
	return texts
}

// insertFinishedSagas writes n credited transfer sagas with keys prefix1..n,
// finished `ago` (a PostgreSQL interval) before now, each with a deduct and
// a credit step and their two inbox rows written when the saga started.
func insertFinishedSagas(t *testing.T, pool *pgxpool.Pool, prefix string, n int, ago string) {
	t.Helper()
	execSQL(t, pool, `insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state, created_at, updated_at, finished_at)
select gen_random_uuid(), 'transfer', $1 || g, '\x00', '{}', 'credited',
  now() - $3::interval - interval '1 minute', now() - $3::interval, now() - $3::interval
from generate_series(1, $2::int) g`, prefix, n, ago)
	execSQL(t, pool, `insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, created_at, updated_at)
select s.id, x.step, 'forward', x.idx, gen_random_uuid(), 'succeeded', 1, s.created_at, s.finished_at
from idemsaga.sagas s cross join (values ('deduct', 0), ('credit', 1)) x (step, idx)
where s.idem_key like $1 || '%'`, prefix)
	execSQL(t, pool, `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome, created_at)
select st.key, st.saga_id, st.step, st.phase, 1, 'succeeded', st.created_at
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id
where s.idem_key like $1 || '%'`, prefix)
	// A retried first attempt of each credit, in the timeline.
	execSQL(t, pool, `insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome)
select st.saga_id, st.step, st.phase, 1, st.created_at, st.created_at, 'retry'
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id
where s.idem_key like $1 || '%' and st.step = 'credit'`, prefix)
}

// insertOutbox writes n outbox rows created `ago` before now, published
// then when published is true, unpublished otherwise.
func insertOutbox(t *testing.T, pool *pgxpool.Pool, n int, ago string, published bool) {
	t.Helper()
	execSQL(t, pool, `insert into idemsaga.outbox (subject, msg_id, payload, created_at, published_at)
select 't.retention', 'm-' || gen_random_uuid(), '\x00', now() - $2::interval,
  case when $3::bool then now() - $2::interval end
from generate_series(1, $1::int)`, n, ago, published)
}

// TestRetentionDeletesOnlyWhatCannotBeRedelivered runs real transfers to
// completion, adds running sagas, then ages everything and cleans once:
// finished sagas past the window go with their steps and inbox rows;
// everything a command could still need stays.
func TestRetentionDeletesOnlyWhatCannotBeRedelivered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seedForLoad(t, pool)
	stream := testenv.Name("RETAIN")
	// Published rows are kept (marked), to be cleaned past their window.
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.Retention.PublishedOutbox = time.Hour })
	const n = 30
	submitTransfers(t, def, n, e.Client())
	waitAllFinished(t, pool, time.Minute)
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, e.Stop(stopCtx)) // nothing moves from here on
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is null`), "the run's outbox is drained")

	// Running sagas, started with no engine to run them: their first
	// command stays unpublished. run-0's deduct is recorded in the inbox as
	// if a step worker had processed it; run-2 is marked finished while its
	// step is still dispatched (an inconsistency the cleaner must not
	// trust). All of it is 30 days old.
	cl := brokerClient(t, pool, stream, def)
	for i, k := range []string{"run-0", "run-1", "run-2"} {
		res, err := cl.Start(ctx, def, k, transferInput(1, 2, int64(i+1)))
		require.NoError(t, err)
		if k == "run-0" {
			execSQL(t, pool, `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome, result)
values ($1, $2, 'deduct', 'forward', 1, 'succeeded', '{}')`, saga.StepKey(res.ID, fixture.StepDeduct, saga.PhaseForward), res.ID)
		}
	}
	execSQL(t, pool, `update idemsaga.sagas set created_at = now() - interval '30 days' where idem_key like 'run-%'`)
	execSQL(t, pool, `update idemsaga.sagas set finished_at = now() - interval '30 days' where idem_key = 'run-2'`)
	execSQL(t, pool, `update idemsaga.steps set created_at = now() - interval '30 days'
where saga_id in (select id from idemsaga.sagas where idem_key like 'run-%')`)
	execSQL(t, pool, `update idemsaga.inbox set created_at = now() - interval '30 days'
where saga_id in (select id from idemsaga.sagas where idem_key like 'run-%')`)
	execSQL(t, pool, `update idemsaga.outbox set created_at = now() - interval '30 days' where published_at is null`)

	// Finished sagas: keys 0-9 finished 8 days ago (past the 7-day
	// window), 10-19 six days ago, 20-29 just now; key 24 failed 30 days
	// ago and key 25 was parked then: both wait for a person. Their inbox
	// rows are as old as they are.
	age := func(keys []string, ago string) {
		execSQL(t, pool, `update idemsaga.sagas set finished_at = now() - $2::interval, created_at = now() - $2::interval - interval '1 minute'
where idem_key = any($1)`, keys, ago)
		execSQL(t, pool, `update idemsaga.inbox set created_at = now() - $2::interval - interval '1 minute'
where saga_id in (select id from idemsaga.sagas where idem_key = any($1))`, keys, ago)
	}
	keysOf := func(from, to int) []string {
		var ks []string
		for i := from; i < to; i++ {
			ks = append(ks, key(i))
		}
		return ks
	}
	expired, inside := keysOf(0, 10), keysOf(10, 20)
	age(expired, "8 days")
	age(inside, "6 days")
	age([]string{key(24), key(25)}, "30 days")
	execSQL(t, pool, `update idemsaga.sagas set state = 'failed' where idem_key = $1`, key(24))
	execSQL(t, pool, `update idemsaga.sagas set state = 'parked' where idem_key = $1`, key(25))
	// Published outbox rows: the older half was published two hours ago,
	// past the one-hour window; the rest just now.
	execSQL(t, pool, `update idemsaga.outbox set published_at = now() - interval '2 hours'
where published_at is not null and id <= (select percentile_disc(0.5) within group (order by id) from idemsaga.outbox where published_at is not null)`)

	var expiredInput []byte
	var expiredID uuid.UUID
	require.NoError(t, pool.QueryRow(ctx, `select id, input from idemsaga.sagas where idem_key = $1`, key(5)).Scan(&expiredID, &expiredInput))

	want := maintenance.CleanResult{
		Sagas:  countSQL(t, pool, `select count(*) from idemsaga.sagas where idem_key = any($1)`, expired),
		Steps:  countSQL(t, pool, `select count(*) from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where s.idem_key = any($1)`, expired),
		Inbox:  countSQL(t, pool, `select count(*) from idemsaga.inbox i join idemsaga.sagas s on s.id = i.saga_id where s.idem_key = any($1)`, expired),
		Outbox: countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at < now() - interval '1 hour'`),
		// One batch each: finished sagas (their steps, attempts and inbox
		// rows with them), outbox.
		Batches: 2,
	}
	require.Equal(t, int64(10), want.Sagas)
	require.Positive(t, want.Steps)
	require.Positive(t, want.Outbox)

	// What must survive, as it is.
	keptSagas := `select id, idem_key, state, version, finished_at from idemsaga.sagas where not (idem_key = any($1))`
	keptSteps := `select st.* from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where not (s.idem_key = any($1))`
	keptInbox := `select i.* from idemsaga.inbox i join idemsaga.sagas s on s.id = i.saga_id where not (s.idem_key = any($1))`
	keptOutbox := `select * from idemsaga.outbox where published_at is null or published_at > now() - interval '1 hour'`
	before := map[string][]string{
		"sagas": rowsJSON(t, pool, keptSagas, expired), "steps": rowsJSON(t, pool, keptSteps, expired),
		"inbox": rowsJSON(t, pool, keptInbox, expired), "outbox": rowsJSON(t, pool, keptOutbox),
	}
	require.Len(t, before["sagas"], n-10+3)
	require.Positive(t, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is null`), "running sagas have unpublished commands")

	c := newCleaner(t, pool, engine.RetentionConfig{PublishedOutbox: time.Hour})
	got, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, want, got)

	after := map[string][]string{
		"sagas": rowsJSON(t, pool, keptSagas, expired), "steps": rowsJSON(t, pool, keptSteps, expired),
		"inbox": rowsJSON(t, pool, keptInbox, expired), "outbox": rowsJSON(t, pool, keptOutbox),
	}
	require.Equal(t, before, after, "running sagas, sagas inside the window, the failed and parked sagas and the outbox's unpublished and recent rows are untouched")
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.sagas where idem_key = any($1)`, expired))
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.inbox where saga_id = $1`, expiredID), "the saga's dedup records went with it")
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at < now() - interval '1 hour'`))

	again, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanResult{}, again, "a second pass finds nothing")

	// The replay window: inside it a key names its saga; past it the key
	// is free, and starting it again creates a new saga with new step keys.
	var in fixture.Input
	var insideInput []byte
	var insideID uuid.UUID
	require.NoError(t, pool.QueryRow(ctx, `select id, input from idemsaga.sagas where idem_key = $1`, key(15)).Scan(&insideID, &insideInput))
	require.NoError(t, json.Unmarshal(insideInput, &in))
	res, err := cl.Start(ctx, def, key(15), in)
	require.NoError(t, err)
	require.True(t, res.Duplicate, "inside the window the key names its saga")
	require.Equal(t, insideID, res.ID)

	require.NoError(t, json.Unmarshal(expiredInput, &in))
	res, err = cl.Start(ctx, def, key(5), in)
	require.NoError(t, err)
	require.False(t, res.Duplicate, "past the window the key starts a new saga")
	require.NotEqual(t, expiredID, res.ID)
	require.NotEqual(t, saga.StepKey(expiredID, fixture.StepDeduct, saga.PhaseForward), saga.StepKey(res.ID, fixture.StepDeduct, saga.PhaseForward))
}

// TestRetentionLateCommandOfADeletedSagaIsDropped: a saga's records go
// together, after its window; a command of it delivered after that (one a
// broker kept past the window) finds no saga to claim a key of, and is
// dropped: it never runs its step again.
func TestRetentionLateCommandOfADeletedSagaIsDropped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	_, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	stream := testenv.Name("RETLATE")
	// Started by a client that runs nothing, so the test can read the
	// deduct command before an engine runs it: a copy as the broker could
	// still hold it.
	res, err := brokerClient(t, pool, stream, def).Start(ctx, def, "late", transferInput(1, 2, 40))
	require.NoError(t, err)
	var payload []byte
	require.NoError(t, pool.QueryRow(ctx, `select payload from idemsaga.outbox where subject = $1 order by id limit 1`, wire.Subjects{Prefix: "t." + stream}.Command(def.Name(), fixture.StepDeduct)).Scan(&payload))
	cmd, err := wire.DecodeCommand(payload)
	require.NoError(t, err)
	require.Equal(t, res.ID, cmd.SagaID)

	e := startEngine(t, pool, nc, stream, []*saga.Definition{def})
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	sg, err := e.Client().Wait(wctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, fixture.StateCredited, sg.State)
	require.NoError(t, e.Stop(wctx))

	require.Equal(t, int64(2), countSQL(t, pool, `select count(*) from idemsaga.inbox where saga_id = $1`, res.ID))
	execSQL(t, pool, `update idemsaga.sagas set finished_at = now() - interval '8 days' where id = $1`, res.ID)
	c := newCleaner(t, pool, engine.RetentionConfig{})
	got, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanResult{Sagas: 1, Steps: 2, Inbox: 2, Batches: 1}, got)

	balances := rowsJSON(t, pool, `select id, balance from fixture.accounts`)
	ledger := countSQL(t, pool, `select count(*) from fixture.ledger`)
	w := newReplyWorker(t, pool, "t."+stream, 0, def)
	reply, err := w.Handle(ctx, cmd)
	require.NoError(t, err, "the late command is answered, not delivered again forever")
	require.True(t, reply.Duplicate)
	require.Contains(t, reply.Error, "no longer exists")
	require.Equal(t, balances, rowsJSON(t, pool, `select id, balance from fixture.accounts`), "no second effect")
	require.Equal(t, ledger, countSQL(t, pool, `select count(*) from fixture.ledger`))
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.inbox where saga_id = $1`, res.ID), "and nothing recorded for a saga that is gone")
}

// TestRetentionDeletesInBatches cleans 50 sagas and 50 outbox rows with
// BatchSize 7: one CleanOnce loops until a batch comes back short, so each
// kind takes 8 transactions (7 full ones and one of 1).
func TestRetentionDeletesInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertFinishedSagas(t, pool, "old-", 50, "8 days")
	insertOutbox(t, pool, 50, "2 hours", true)

	c := newCleaner(t, pool, engine.RetentionConfig{BatchSize: 7, PublishedOutbox: time.Hour})
	got, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanResult{Sagas: 50, Steps: 100, Inbox: 100, Outbox: 50, Batches: 16}, got)
	for _, table := range []string{"sagas", "steps", "inbox", "outbox"} {
		require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.`+table), table)
	}
}

// TestRetentionConcurrentCleanersDeleteOnce runs two cleaners, on two
// pools, twice each and all at once, on the same rows: every row is deleted
// exactly once and nobody fails.
func TestRetentionConcurrentCleanersDeleteOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := testenv.DBWithURL(t)
	pool2, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool2.Close)
	insertFinishedSagas(t, pool, "old-", 200, "8 days")
	insertOutbox(t, pool, 300, "2 hours", true)
	// Kept by both: running and young rows.
	insertFinishedSagas(t, pool, "young-", 20, "1 day")
	insertOutbox(t, pool, 20, "30 days", false)

	cfg := engine.RetentionConfig{BatchSize: 10, PublishedOutbox: time.Hour}
	cleaners := []*maintenance.Cleaner{newCleaner(t, pool, cfg), newCleaner(t, pool2, cfg)}
	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]maintenance.CleanResult, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Go(func() {
			<-start
			results[i], errs[i] = cleaners[i%2].CleanOnce(ctx)
		})
	}
	close(start)
	wg.Wait()
	t.Logf("each cleaner's share: %+v", results)
	var total maintenance.CleanResult
	for i := range results {
		require.NoError(t, errs[i])
		total.Sagas += results[i].Sagas
		total.Steps += results[i].Steps
		total.Inbox += results[i].Inbox
		total.Outbox += results[i].Outbox
	}
	require.Equal(t, maintenance.CleanResult{Sagas: 200, Steps: 400, Inbox: 400, Outbox: 300}, total)
	require.Equal(t, int64(20), countSQL(t, pool, `select count(*) from idemsaga.sagas`))
	require.Equal(t, int64(40), countSQL(t, pool, `select count(*) from idemsaga.steps`))
	require.Equal(t, int64(40), countSQL(t, pool, `select count(*) from idemsaga.inbox`))
	require.Equal(t, int64(20), countSQL(t, pool, `select count(*) from idemsaga.step_attempts`), "attempts go with their saga, and only with it")
	require.Equal(t, int64(20), countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is null`))
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is not null`))
}

// TestRetentionConfigValidation checks defaults and that every bad value
// is refused with an error naming its field.
func TestRetentionConfigValidation(t *testing.T) {
	t.Parallel()
	// A pool that is never used: validation needs no database.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?sslmode=disable")
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	c, err := engine.NewCleaner(pool, engine.RetentionConfig{}, nil)
	require.NoError(t, err)
	require.Equal(t, maintenance.CleanerConfig{
		FinishedSagas:   engine.FinishedSagasDefault,
		PublishedOutbox: engine.PublishedOutboxDefault, BatchSize: engine.RetentionBatchSizeDefault,
		Interval: engine.RetentionIntervalDefault,
	}, c.Config())
	require.Equal(t, 7*24*time.Hour, engine.FinishedSagasDefault)
	require.Zero(t, engine.PublishedOutboxDefault, "published rows are deleted by the relay by default")

	day := 24 * time.Hour
	for _, ok := range []engine.RetentionConfig{
		{FinishedSagas: time.Hour},
		{FinishedSagas: 30 * day},
		{PublishedOutbox: 2*time.Minute + time.Second},
		{PublishedOutbox: 0},
		{BatchSize: 1, Interval: time.Millisecond},
		{BatchSize: 10_000},
		{DeleteFailed: true},
		{FinishedSagas: engine.KeepForever, PublishedOutbox: engine.KeepForever},
	} {
		_, err := engine.NewCleaner(pool, ok, nil)
		require.NoError(t, err, "%+v", ok)
	}

	for _, bad := range []struct {
		cfg   engine.RetentionConfig
		field string
	}{
		{engine.RetentionConfig{FinishedSagas: -time.Second}, "FinishedSagas"},
		{engine.RetentionConfig{PublishedOutbox: -time.Second}, "PublishedOutbox"},
		{engine.RetentionConfig{Interval: -time.Second}, "Interval"},
		{engine.RetentionConfig{BatchSize: -1}, "BatchSize"},
		{engine.RetentionConfig{BatchSize: 10_001}, "BatchSize"},
		{engine.RetentionConfig{FinishedSagas: 59 * time.Minute}, "FinishedSagas"},
		{engine.RetentionConfig{PublishedOutbox: 2 * time.Minute}, "PublishedOutbox"},
		{engine.RetentionConfig{PublishedOutbox: time.Second}, "PublishedOutbox"},
	} {
		_, err := engine.NewCleaner(pool, bad.cfg, nil)
		require.Error(t, err, "%+v", bad.cfg)
		require.Contains(t, err.Error(), "RetentionConfig."+bad.field, "%+v", bad.cfg)
	}

	_, err = engine.NewCleaner(nil, engine.RetentionConfig{}, nil)
	require.ErrorContains(t, err, "pool")
}

// TestCleanerStartStop runs the cleaner in the background: it cleans at
// once and then every Interval, refuses a second Start, and stops twice.
func TestCleanerStartStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertFinishedSagas(t, pool, "old-", 3, "8 days")
	c := newCleaner(t, pool, engine.RetentionConfig{Interval: 20 * time.Millisecond, PublishedOutbox: time.Hour})
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
	require.ErrorIs(t, c.Start(ctx), lifecycle.ErrAlreadyStarted)

	gone := func() bool { return countSQL(t, pool, `select count(*) from idemsaga.sagas`) == 0 }
	require.Eventually(t, gone, 10*time.Second, 10*time.Millisecond, "cleaned at start")
	insertOutbox(t, pool, 5, "2 hours", true)
	require.Eventually(t, func() bool {
		return countSQL(t, pool, `select count(*) from idemsaga.outbox`) == 0
	}, 10*time.Second, 10*time.Millisecond, "cleaned again after Interval")

	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, c.Stop(stopCtx))
	require.NoError(t, c.Stop(stopCtx), "a second Stop is fine")

	// CleanOnce with an ended context deletes nothing and says so.
	insertOutbox(t, pool, 1, "2 hours", true)
	done, cancelDone := context.WithCancel(ctx)
	cancelDone()
	res, err := c.CleanOnce(done)
	require.True(t, errors.Is(err, context.Canceled), "%v", err)
	require.Equal(t, maintenance.CleanResult{}, res)
	require.True(t, strings.Contains(err.Error(), "retention"))
	require.Equal(t, int64(1), countSQL(t, pool, `select count(*) from idemsaga.outbox`))
}

// TestRetentionKeepsASagaWithUnpublishedMessages: a finished saga whose
// command the broker has not taken yet (a refused row, say) is kept past
// the window, with its inbox rows: that command may still be delivered.
func TestRetentionKeepsASagaWithUnpublishedMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transferDef(t)}})
	require.NoError(t, err)
	res, err := cl.Start(ctx, transferDef(t), "stuck-in-outbox", transferInput(1, 2, 3))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set status = 'failed' where saga_id = $1`, res.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.sagas set state = 'compensated', finished_at = now() - interval '30 days' where id = $1`, res.ID)
	require.NoError(t, err)

	c, err := engine.NewCleaner(pool, engine.RetentionConfig{}, quietLogger())
	require.NoError(t, err)
	got, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, got.Sagas, "kept while its command is unpublished")

	_, err = pool.Exec(ctx, `update idemsaga.outbox set published_at = now() where saga_id = $1`, res.ID)
	require.NoError(t, err)
	got, err = c.CleanOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, got.Sagas)
}

// TestRetentionDeletesMarkedRowsWhenRelayDeletes: with PublishedOutbox 0
// (the relay deletes what it publishes), rows marked published by an
// engine that keeps them, or by an older version, still go after an hour.
func TestRetentionDeletesMarkedRowsWhenRelayDeletes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertOutbox(t, pool, 4, "2 hours", true)
	insertOutbox(t, pool, 3, "30 minutes", true)
	insertOutbox(t, pool, 2, "30 days", false)
	c := newCleaner(t, pool, engine.RetentionConfig{})
	got, err := c.CleanOnce(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 4, got.Outbox)
	require.EqualValues(t, 3, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is not null`), "marked rows younger than an hour stay")
	require.EqualValues(t, 2, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at is null`), "unpublished rows stay")
}
