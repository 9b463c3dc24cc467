package engine_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// testClock moves idemsaga.now() of one test database, as the test kit's
// clock does.
type testClock struct{ pool *pgxpool.Pool }

func installClock(t testing.TB, pool *pgxpool.Pool) *testClock {
	t.Helper()
	_, err := pool.Exec(context.Background(), `create schema testclock;
create table testclock.clock (offset_ms bigint not null);
insert into testclock.clock values (0);
create or replace function idemsaga.now() returns timestamptz language sql stable parallel safe
as $$ select pg_catalog.now() + (select offset_ms from testclock.clock) * interval '1 millisecond' $$;`)
	require.NoError(t, err)
	return &testClock{pool: pool}
}

func (c *testClock) Advance(t testing.TB, d time.Duration) {
	t.Helper()
	_, err := c.pool.Exec(context.Background(), `update testclock.clock set offset_ms = offset_ms + $1`, d.Milliseconds())
	require.NoError(t, err)
}

// tickDef is a one-step definition that does nothing, scheduled by s.
func tickDef(name string, s saga.Schedule) *saga.Definition {
	return saga.WithSchedule(saga.MustNew(name, saga.Step{
		Name: "run", Reaches: "ran", Kind: saga.DatabaseStep, Retry: fastPolicy,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
	}), s)
}

// scheduleRow reads a schedule's last tick handled.
func lastTick(t testing.TB, pool *pgxpool.Pool, definition string) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `select last_tick from idemsaga.schedules where definition = $1`, definition).Scan(&at))
	return at
}

// waitSagaByKey waits up to 30 s for the saga of definition under key to
// exist.
func waitSagaByKey(t testing.TB, pool *pgxpool.Pool, definition, key string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.sagas where definition = $1 and idem_key = $2`, definition, key).Scan(&n))
		if n == 1 {
			return
		}
		require.False(t, time.Now().After(deadline), "no saga %s %q after 30 s", definition, key)
		time.Sleep(5 * time.Millisecond)
	}
}

// sagaKeys returns the keys of definition's sagas, in order.
func sagaKeys(t testing.TB, pool *pgxpool.Pool, definition string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select idem_key from idemsaga.sagas where definition = $1 order by idem_key`, definition)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

// ticksAfter returns the ticks of spec after from and at or before to.
func ticksAfter(t testing.TB, spec string, from, to time.Time) []time.Time {
	t.Helper()
	c, err := saga.ParseCron(spec)
	require.NoError(t, err)
	var out []time.Time
	for tick := c.Next(from); !tick.After(to); tick = c.Next(tick) {
		out = append(out, tick)
	}
	return out
}

func scheduleEngine(interval time.Duration, reg *prometheus.Registry) engineOpt {
	return func(c *engine.Config) {
		c.ScheduleInterval = interval
		if reg != nil {
			c.Registerer = reg
			c.ReconcileInterval = engine.NoReconcile
		}
	}
}

// Two workers on one database race for every tick: each tick starts one
// saga, started by one of them (no pass of the other even tries it).
func TestScheduleTwoWorkersStartEachTickOnce(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	clock := installClock(t, pool)
	_, nc := testenv.NATS(t)
	const spec = "*/5 * * * *"
	def := tickDef("nightly", saga.Schedule{Cron: spec})
	regs := []*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	engines := []*engine.Engine{
		startEngine(t, pool, nc, "SCHED2", []*saga.Definition{def}, scheduleEngine(2*time.Millisecond, regs[0])),
		startEngine(t, pool, nc, "SCHED2", []*saga.Definition{def}, scheduleEngine(2*time.Millisecond, regs[1])),
	}
	start := lastTick(t, pool, "nightly")
	var want []string
	const rounds = 12
	for range rounds {
		clock.Advance(t, 5*time.Minute)
		var now time.Time
		require.NoError(t, pool.QueryRow(context.Background(), `select idemsaga.now()`).Scan(&now))
		ticks := ticksAfter(t, spec, start, now)
		require.NotEmpty(t, ticks)
		key := saga.TickKey(ticks[len(ticks)-1])
		waitSagaByKey(t, pool, "nightly", key)
		if len(want) == 0 || want[len(want)-1] != key {
			want = append(want, key)
		}
	}
	require.Len(t, want, rounds, "each 5-minute step of the clock makes one tick due")
	require.Equal(t, want, sagaKeys(t, pool, "nightly"), "one saga per tick, under the tick's key")
	// A pass counts its ticks once it committed: the last saga can be
	// read before its pass counted it.
	ticks := func(outcome string) float64 {
		sum := 0.0
		for _, reg := range regs {
			sum += metricSum(t, reg, "idemsaga_schedule_ticks_total", map[string]string{"definition": "nightly", "outcome": outcome})
		}
		return sum
	}
	require.Eventually(t, func() bool { return ticks("started") >= rounds }, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, float64(rounds), ticks("started"), "each tick was started by one pass of one worker")
	require.Zero(t, ticks("duplicate"), "no pass tried a tick another had started: the schedule's row lock decides, not only the key")
	for _, id := range sagaIDs(t, pool, "nightly") {
		sg := waitState(t, engines[0].Client(), id, "ran")
		var in saga.TickInput
		require.NoError(t, json.Unmarshal(sg.Input, &in))
		require.Equal(t, saga.TickKey(in.Tick), sg.Key, "the default input is the tick")
	}
}

func sagaIDs(t testing.TB, pool *pgxpool.Pool, definition string) []uuid.UUID {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select id from idemsaga.sagas where definition = $1 order by idem_key`, definition)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	return ids
}

// Ticks missed while every worker was down: the latest due and CatchUp
// before it start on return, the older are skipped and counted.
func TestScheduleCatchUpIsBounded(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	clock := installClock(t, pool)
	_, nc := testenv.NATS(t)
	const spec = "*/5 * * * *"
	def := tickDef("catchup", saga.Schedule{Cron: spec, CatchUp: 2})
	// The clock runs on with the wall's: keep a tick from falling due
	// between the first engine's last tick and the hour's count.
	var at time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `select idemsaga.now()`).Scan(&at))
	if next := at.Truncate(5 * time.Minute).Add(5 * time.Minute); next.Sub(at) < 30*time.Second {
		clock.Advance(t, next.Sub(at)+time.Second)
	}
	first := startEngine(t, pool, nc, "SCHEDCU", []*saga.Definition{def}, scheduleEngine(time.Hour, nil))
	require.NoError(t, first.Stop(context.Background()))
	start := lastTick(t, pool, "catchup")
	clock.Advance(t, time.Hour)
	var now time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `select idemsaga.now()`).Scan(&now))
	ticks := ticksAfter(t, spec, start, now)
	require.Len(t, ticks, 12)

	reg := prometheus.NewRegistry()
	startEngine(t, pool, nc, "SCHEDCU", []*saga.Definition{def}, scheduleEngine(5*time.Millisecond, reg))
	var want []string
	for _, tick := range ticks[9:] {
		want = append(want, saga.TickKey(tick))
	}
	waitSagaByKey(t, pool, "catchup", want[2])
	require.Equal(t, want, sagaKeys(t, pool, "catchup"), "the latest due tick and the 2 missed before it")
	require.True(t, lastTick(t, pool, "catchup").Equal(ticks[11]))
	// Counted once the pass committed, which may follow the read above.
	waitMetric(t, reg, "idemsaga_schedule_ticks_total", map[string]string{"definition": "catchup", "outcome": "started"}, 3)
	waitMetric(t, reg, "idemsaga_schedule_ticks_total", map[string]string{"definition": "catchup", "outcome": "skipped"}, 9)
}

// A paused schedule starts nothing; its ticks meanwhile are skipped, and
// a resume starts from the next tick.
func TestSchedulePauseResume(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	clock := installClock(t, pool)
	_, nc := testenv.NATS(t)
	const spec = "*/5 * * * *"
	def := tickDef("paused", saga.Schedule{Cron: spec})
	e := startEngine(t, pool, nc, "SCHEDP", []*saga.Definition{def}, scheduleEngine(5*time.Millisecond, nil))
	cl := e.Client()
	ctx := context.Background()

	_, err := cl.PauseSchedule(ctx, "nope", engine.Repair{})
	require.ErrorIs(t, err, engine.ErrScheduleNotFound)

	// A pause in a transaction rolled back never happened.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = cl.PauseScheduleTx(ctx, tx, "paused", engine.Repair{Key: "rolled-back"})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	list, err := cl.Schedules(ctx)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Nil(t, list[0].Paused)

	p, err := cl.PauseSchedule(ctx, "paused", engine.Repair{Key: "p1", Reason: "quarter close", By: "ops"})
	require.NoError(t, err)
	require.False(t, p.Replayed)
	again, err := cl.PauseSchedule(ctx, "paused", engine.Repair{Key: "p1", Reason: "quarter close", By: "ops"})
	require.NoError(t, err)
	require.True(t, again.Replayed, "the same request again changes nothing")
	_, err = cl.PauseSchedule(ctx, "paused", engine.Repair{Key: "p2"})
	require.ErrorIs(t, err, engine.ErrStateForbids)
	_, err = cl.ResumeSchedule(ctx, "paused", engine.Repair{Key: "p1", Reason: "quarter close"})
	require.ErrorIs(t, err, engine.ErrRepairKeyReused)
	list, err = cl.Schedules(ctx)
	require.NoError(t, err)
	require.NotNil(t, list[0].Paused)
	require.Equal(t, "ops", list[0].Paused.By)
	require.Equal(t, "quarter close", list[0].Paused.Reason)

	// The tick due while paused is never started.
	clock.Advance(t, 5*time.Minute)
	_, err = cl.ResumeSchedule(ctx, "paused", engine.Repair{Key: "r1"})
	require.NoError(t, err)
	var resumed time.Time
	require.NoError(t, pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&resumed))
	clock.Advance(t, 5*time.Minute)
	var now time.Time
	require.NoError(t, pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&now))
	ticks := ticksAfter(t, spec, resumed, now)
	require.Len(t, ticks, 1)
	waitSagaByKey(t, pool, "paused", saga.TickKey(ticks[0]))
	require.Equal(t, []string{saga.TickKey(ticks[0])}, sagaKeys(t, pool, "paused"), "only the tick after the resume started")
	list, err = cl.Schedules(ctx)
	require.NoError(t, err)
	require.Nil(t, list[0].Paused)
	require.NotNil(t, list[0].LastStarted)
	require.True(t, list[0].LastStarted.Equal(ticks[0]))
	require.True(t, list[0].Next.After(ticks[0]))
}
