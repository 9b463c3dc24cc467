package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// ledger records which version's handler took effect for each step of
// each saga.
type ledger struct {
	mu  sync.Mutex
	ran map[uuid.UUID][]string
}

func newLedger() *ledger { return &ledger{ran: map[uuid.UUID][]string{}} }

// step is a database step handler of the given version: it waits for
// gate (if any), fails its first attempt if failFirst, then records
// itself.
func (l *ledger) step(version int, name string, gate <-chan struct{}, failFirst bool) saga.HandlerFunc {
	return func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if gate != nil {
			select {
			case <-gate:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		if failFirst && sc.Attempt == 1 {
			return nil, errors.New("first attempts fail")
		}
		l.mu.Lock()
		l.ran[sc.SagaID] = append(l.ran[sc.SagaID], fmt.Sprintf("v%d:%s", version, name))
		l.mu.Unlock()
		return nil, nil
	}
}

func (l *ledger) of(id uuid.UUID) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.ran[id]...)
}

func dbStep(name string, reaches saga.State, h saga.HandlerFunc, p saga.RetryPolicy) saga.Step {
	return saga.Step{Name: name, Reaches: reaches, Kind: saga.DatabaseStep, Forward: h, Retry: p}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func countRows(t *testing.T, ctx context.Context, q *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, q.QueryRow(ctx, sql, args...).Scan(&n))
	return n
}

// TestVersionsSideBySide: a worker of version 1 and a worker of version 2
// of one definition run side by side, with sagas of both in flight.
// Sagas started on version 1 before version 2 was deployed finish on
// version 1's steps (a retry of theirs applied by either worker, taken
// over by version 1's reaper), while new sagas start on version 2 and
// run its three steps; nothing is parked and reconcile finds nothing.
func TestVersionsSideBySide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("VERS")
	l := newLedger()
	gate := make(chan struct{})
	var release sync.Once
	open := func() { release.Do(func() { close(gate) }) }
	t.Cleanup(open) // before the engines stop, should the test fail
	slow := fastPolicy
	slow.Timeout = time.Minute
	v1 := saga.MustNew("ver",
		dbStep("one", "oned", l.step(1, "one", nil, true), fastPolicy),
		dbStep("two", "twoed", l.step(1, "two", gate, false), slow))
	v2 := saga.WithVersion(saga.MustNew("ver",
		dbStep("one", "oned", l.step(2, "one", nil, false), fastPolicy),
		dbStep("two", "twoed", l.step(2, "two", nil, false), fastPolicy),
		dbStep("three", "threed", l.step(2, "three", nil, false), fastPolicy)), 2)
	dl := func(c *engine.Config) { engine.WithDeadLetters(c, 1000, 5*time.Millisecond) }

	// Fewer old sagas than the old worker's step slots: it keeps taking
	// commands while they wait.
	const nOld, n = 4, 8
	old := startEngine(t, pool, nc, stream, []*saga.Definition{v1}, dl)
	olds := make([]uuid.UUID, nOld)
	var wg sync.WaitGroup
	for i := range olds {
		wg.Go(func() {
			res, err := old.Client().Start(ctx, v1, fmt.Sprintf("old-%d", i), map[string]int{"i": i})
			if err == nil {
				olds[i] = res.ID
			}
		})
	}
	wg.Wait()
	// Every old saga is in flight at step two, which waits for the gate.
	waitFor(t, 30*time.Second, "old sagas reach step two", func() bool {
		return countRows(t, ctx, pool, `select count(*) from idemsaga.steps where step = 'two' and status = 'dispatched'`) == nOld
	})

	// Version 2 is deployed beside it.
	next := startEngine(t, pool, nc, stream, []*saga.Definition{v2}, dl)
	admin, err := engine.NewClient(engine.Config{Pool: pool, SubjectPrefix: "t." + stream, LeaseGrace: 10 * time.Second, Logger: quietLogger()})
	require.NoError(t, err)
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from idemsaga.workers where 'ver@2' = any(versions)`),
		"an engine is recorded with its versions when Start returns")
	byName, err := admin.Definition(ctx, "ver")
	require.NoError(t, err)
	require.Equal(t, 2, byName.Version(), "a process without the code starts new sagas on the newest version a worker runs")
	news := make([]uuid.UUID, n)
	for i := range news {
		wg.Go(func() {
			cl := next.Client()
			if i%2 == 1 {
				cl = admin
			}
			def := v2
			if i%2 == 1 {
				def = byName
			}
			res, err := cl.Start(ctx, def, fmt.Sprintf("new-%d", i), map[string]int{"i": i})
			if err == nil {
				news[i] = res.ID
			}
		})
	}
	wg.Wait()
	for i, id := range news {
		require.NotEqual(t, uuid.Nil, id, "new saga %d started", i)
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		sg, err := next.Client().Wait(wctx, id)
		cancel()
		require.NoError(t, err)
		require.Equal(t, saga.State("threed"), sg.State, "%+v", sg)
		require.Equal(t, 2, sg.DefinitionVersion)
		require.Equal(t, []string{"v2:one", "v2:two", "v2:three"}, l.of(id))
	}
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas where definition_version = 1 and finished_at is not null`),
		"the old sagas are still in flight on version 1")

	open()
	for i, id := range olds {
		require.NotEqual(t, uuid.Nil, id, "old saga %d started", i)
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		sg, err := old.Client().Wait(wctx, id)
		cancel()
		require.NoError(t, err)
		require.Equal(t, saga.State("twoed"), sg.State, "%+v", sg)
		require.Equal(t, 1, sg.DefinitionVersion)
		require.Equal(t, []string{"v1:one", "v1:two"}, l.of(id), "a saga runs the version it started with")
		require.Equal(t, 2, sg.Steps[0].Attempt, "step one retried once, on version 1")
	}
	for version, want := range map[int]int{1: nOld, 2: n} {
		listed, err := admin.List(ctx, engine.ListOptions{Definition: "ver", Version: version})
		require.NoError(t, err)
		require.Len(t, listed, want, "sagas of version %d", version)
	}
	_, err = admin.List(ctx, engine.ListOptions{Version: 1})
	require.ErrorIs(t, err, engine.ErrInvalidFilter)
	dls, err := admin.DeadLetters(ctx, engine.DeadLetterFilter{})
	require.NoError(t, err)
	require.Empty(t, dls)
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{v1, v2}, 0)
	require.NoError(t, err)
	require.Empty(t, diffs)
	t.Logf("%d sagas on version 1 and %d on version 2 side by side: every one ran its own version's steps", nOld, n)
}

// TestPoisonCommandParkedAndResumed: a command of a version no running
// worker of its definition knows is delivered a bounded number of times,
// then parked in the dead-letter table and acked (the broker holds
// nothing more for it); it is visible to Get, List, the metrics and
// reconcile, and a worker of its version sends it again at its start (the
// saga finishes at its first attempt, not a lease takeover). A command of
// a definition no running worker runs is not delivered to the workers of
// other definitions at all: it waits in the stream, parked nowhere, and
// the first worker that runs it takes it.
func TestPoisonCommandParkedAndResumed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("POISON")
	l := newLedger()
	other := saga.MustNew("other", dbStep("s", "done", l.step(1, "s", nil, false), fastPolicy))
	lateV1 := saga.MustNew("late", dbStep("go", "gone", l.step(1, "go", nil, false), fastPolicy))
	lateV2 := saga.WithVersion(saga.MustNew("late",
		dbStep("go", "gone", l.step(2, "go", nil, false), fastPolicy),
		dbStep("more", "mored", l.step(2, "more", nil, false), fastPolicy)), 2)
	reg := prometheus.NewRegistry()
	const bound = 3
	dl := func(c *engine.Config) { engine.WithDeadLetters(c, bound, 5*time.Millisecond) }
	startEngine(t, pool, nc, stream, []*saga.Definition{other, lateV1}, dl, func(c *engine.Config) { c.Registerer = reg })

	cl := brokerClient(t, pool, stream, other, lateV1, lateV2)
	first, err := cl.Start(ctx, lateV1, "late-1", map[string]int{"n": 1})
	require.NoError(t, err)
	second, err := cl.Start(ctx, lateV2, "late-2", map[string]int{"n": 2})
	require.NoError(t, err)

	waitFor(t, 30*time.Second, "version 2's command parked", func() bool {
		return countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`) == 1
	})
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	sg, err := cl.Wait(wctx, first.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("gone"), sg.State, "version 1 runs where version 1 runs")
	dls, err := cl.DeadLetters(ctx, engine.DeadLetterFilter{Definition: "late"})
	require.NoError(t, err)
	require.Len(t, dls, 1)
	d := dls[0]
	require.Equal(t, bound, d.Deliveries, "parked after its bound, not before or later")
	require.Contains(t, d.Reason, `runs definition "late" at version 1, not 2`)
	require.Equal(t, []any{second.ID, 2, "go", 1}, []any{d.SagaID, d.DefinitionVersion, d.Step, d.Attempt})
	sg, err = cl.Get(ctx, second.ID)
	require.NoError(t, err)
	require.Len(t, sg.DeadLetters, 1)
	listed, err := cl.List(ctx, engine.ListOptions{DeadLettered: true})
	require.NoError(t, err)
	require.Len(t, listed, 1)
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_dead_letters", map[string]string{"definition": "late"}))
	waitMetric(t, reg, "idemsaga_dead_letters_parked_total", map[string]string{"definition": "late"}, 1) // counted once its statement returned
	require.Equal(t, float64(bound-1), metricSum(t, reg, "idemsaga_commands_handed_back_total", map[string]string{"definition": "late"}), "handed back until parked")
	diffs, err := engine.Reconcile(ctx, pool, []*saga.Definition{other, lateV1, lateV2}, 0)
	require.NoError(t, err)
	require.Len(t, diffs, 1, "%v", diffs)
	require.Contains(t, diffs[0].What, "running with a command parked")
	require.Contains(t, diffs[0].What, "no live worker runs late version 2")
	// The broker holds nothing more: parked means acked, not redelivered.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	cons, err := js.Consumer(ctx, stream, stream+"_steps_late")
	require.NoError(t, err)
	waitFor(t, 10*time.Second, "the step consumer has nothing pending", func() bool {
		info, err := cons.Info(ctx)
		require.NoError(t, err)
		return info.NumAckPending == 0 && info.NumPending == 0
	})

	// A definition nobody runs: its command waits in the stream, and
	// the workers of other definitions never see it.
	ghost := saga.MustNew("ghost", dbStep("boo", "booed", l.step(1, "boo", nil, false), fastPolicy))
	gcl := brokerClient(t, pool, stream, ghost)
	third, err := gcl.Start(ctx, ghost, "ghost-1", map[string]int{"n": 3})
	require.NoError(t, err)
	s, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	waitFor(t, 10*time.Second, "the ghost's command is in the stream", func() bool {
		info, err := s.Info(ctx, jetstream.WithSubjectFilter("t."+stream+".cmd.ghost.>"))
		require.NoError(t, err)
		return len(info.State.Subjects) == 1
	})
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`), "nobody parked the ghost's command")

	// A worker of version 2, and of the ghost, arrive: version 2's parked
	// command is sent again, the ghost's is taken from the stream.
	startEngine(t, pool, nc, stream, []*saga.Definition{lateV1, lateV2, ghost}, dl)
	sg, err = cl.Wait(wctx, second.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("mored"), sg.State)
	require.Equal(t, 1, sg.Steps[0].Attempt, "resumed from the dead letter, not taken over after the lease")
	require.Equal(t, []string{"v2:go", "v2:more"}, l.of(second.ID))
	sg, err = gcl.Wait(wctx, third.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("booed"), sg.State)
	require.Equal(t, 1, sg.Steps[0].Attempt, "taken from the stream, not after a lease")
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`))
	require.Equal(t, 0.0, metricSum(t, reg, "idemsaga_dead_letters", nil))
	diffs, err = engine.Reconcile(ctx, pool, []*saga.Definition{other, lateV1, lateV2, ghost}, 0)
	require.NoError(t, err)
	require.Empty(t, diffs)
}

// parkByHand parks the saga's first command, as a worker that cannot run
// it does, and returns the dead letter's id.
func parkByHand(t *testing.T, ctx context.Context, pool *pgxpool.Pool, id uuid.UUID, msgID string) int64 {
	t.Helper()
	var dl int64
	require.NoError(t, pool.QueryRow(ctx, `insert into idemsaga.dead_letters (msg_id, subject, payload, saga_id, definition, definition_version,
  step, phase, attempt, reason, deliveries, parked_by, first_seen)
select $2, o.subject, o.payload, o.saga_id, s.definition, s.definition_version, convert_from(o.payload, 'UTF8')::jsonb->>'step', 'forward', 1, 'by hand', 5, 'test', idemsaga.now()
from idemsaga.outbox o join idemsaga.sagas s on s.id = o.saga_id where o.saga_id = $1 order by o.id limit 1
returning id`, id, msgID).Scan(&dl))
	return dl
}

// TestDeadLettersResendAndDrop: twenty concurrent resends of one dead
// letter send it once (one outbox row, under a new message id, so the
// broker's dedup window does not drop it); the others are told it is
// not parked. A drop naming an id that is not parked drops nothing.
func TestDeadLettersResendAndDrop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, LeaseGrace: 10 * time.Second, Logger: quietLogger()})
	require.NoError(t, err)
	res, err := cl.Start(ctx, def, "dl-1", transferInput(1, 2, 3))
	require.NoError(t, err)
	id := parkByHand(t, ctx, pool, res.ID, "c-msg-1")

	const n = 20
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range errs {
		wg.Go(func() {
			<-gate
			errs[i] = cl.ResendDeadLetters(ctx, id)
		})
	}
	close(gate)
	wg.Wait()
	ok, notFound := 0, 0
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, engine.ErrDeadLetterNotFound):
			notFound++
		default:
			t.Fatalf("unexpected error: %v", err)
		}
	}
	require.Equal(t, 1, ok)
	require.Equal(t, n-1, notFound)
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from idemsaga.outbox where msg_id = $1`, fmt.Sprintf("c-msg-1-dl%d", id)))
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`))
	t.Logf("%d concurrent resends of one dead letter: %d sent, %d not parked any more, 1 outbox row", n, ok, notFound)

	// Parked again after its resend: the suffix is replaced, not stacked.
	again := parkByHand(t, ctx, pool, res.ID, fmt.Sprintf("c-msg-1-dl%d", id))
	require.NoError(t, cl.ResendDeadLetters(ctx, again))
	require.Equal(t, 1, countRows(t, ctx, pool, `select count(*) from idemsaga.outbox where msg_id = $1`, fmt.Sprintf("c-msg-1-dl%d", again)))

	a := parkByHand(t, ctx, pool, res.ID, "c-msg-2")
	b := parkByHand(t, ctx, pool, res.ID, "c-msg-3")
	err = cl.DropDeadLetters(ctx, a, 999999)
	require.ErrorIs(t, err, engine.ErrDeadLetterNotFound)
	require.True(t, strings.Contains(err.Error(), "nothing was dropped"), err.Error())
	require.Equal(t, 2, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`), "bad input changes nothing")
	err = cl.ResendDeadLetters(ctx, a, 999999)
	require.ErrorIs(t, err, engine.ErrDeadLetterNotFound)
	require.Equal(t, 2, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`), "bad input changes nothing")
	require.NoError(t, cl.DropDeadLetters(ctx, a, b))
	require.ErrorIs(t, cl.DropDeadLetters(ctx, a), engine.ErrDeadLetterNotFound)
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Empty(t, sg.DeadLetters)
	require.Equal(t, saga.StateInit, sg.State, "a drop leaves the saga as it is")
}

// TestResentDeadLettersRunNothingTwice: twenty transfers whose first
// command is both delivered and parked three times over are resumed by a
// worker of their version (its heartbeat and eight concurrent passes at
// once): every parked copy is sent exactly once, and each transfer's
// money moves once.
func TestResentDeadLettersRunNothingTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("RESUME")
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 10, 1000)
	require.NoError(t, err)
	cl := brokerClient(t, pool, stream, def)
	const sagas, copies = 20, 3
	ids := make([]uuid.UUID, sagas)
	for i := range ids {
		res, err := cl.Start(ctx, def, fmt.Sprintf("resume-%d", i), transferInput(1, 2, 1))
		require.NoError(t, err)
		ids[i] = res.ID
		for c := range copies {
			parkByHand(t, ctx, pool, res.ID, fmt.Sprintf("parked-%d-%d", i, c))
		}
	}
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, func(c *engine.Config) { c.Registerer = reg })
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_, err := e.ResumeDeadLetters(ctx)
			require.NoError(t, err)
		})
	}
	wg.Wait()
	for _, id := range ids {
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		sg, err := cl.Wait(wctx, id)
		cancel()
		require.NoError(t, err)
		require.Equal(t, fixture.StateCredited, sg.State)
	}
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`))
	require.Equal(t, float64(sagas*copies), metricSum(t, reg, "idemsaga_dead_letters_resumed_total", map[string]string{"how": "worker"}))
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	var b1, b2 int64
	require.NoError(t, pool.QueryRow(ctx, `select (select balance from fixture.accounts where id = 1), (select balance from fixture.accounts where id = 2)`).Scan(&b1, &b2))
	require.Equal(t, []int64{1000 - sagas, 1000 + sagas}, []int64{b1, b2}, "each transfer moved its money once")
	t.Logf("%d sagas, %d parked copies each, resumed by 9 concurrent passes: %d sent once each, balances moved %d times", sagas, copies, sagas*copies, sagas)
}
