package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestSuccessAppliedInStepConcurrently delivers each command of one
// transfer to twenty goroutines across four engines at once. A success
// moves the saga on inside the step's own transaction, with no reply:
// exactly one delivery takes effect, the saga moves once per step, the
// next step is dispatched once, and money is conserved.
func TestSuccessAppliedInStepConcurrently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	stream := testenv.Name("INSTEP")

	// Not started: the goroutines play the step workers.
	engines := make([]*engine.Engine, 4)
	regs := make([]*prometheus.Registry, len(engines))
	for i := range engines {
		regs[i] = prometheus.NewRegistry()
		engines[i] = idleEngine(t, pool, nc, stream, regs[i], def)
	}
	res, err := engines[0].Client().Start(ctx, def, "in-step", transferInput(1, 2, 70))
	require.NoError(t, err)

	for step, state := range []string{"deducted", "credited"} {
		cmd := latestCommand(t, pool)
		require.Equal(t, def.Step(step).Name, cmd.Step)

		const perEngine = 5
		var wg sync.WaitGroup
		replies := make([]wire.Reply, len(engines)*perEngine)
		errs := make([]error, len(replies))
		start := make(chan struct{})
		for i := range replies {
			wg.Go(func() {
				<-start
				replies[i], errs[i] = engines[i%len(engines)].HandleCommand(ctx, cmd)
			})
		}
		close(start)
		wg.Wait()
		fresh := 0
		for i := range replies {
			require.NoError(t, errs[i])
			require.Equal(t, wire.OutcomeSucceeded, replies[i].Outcome)
			if !replies[i].Duplicate {
				fresh++
			}
		}
		require.Equal(t, 1, fresh, "one delivery takes effect; the rest are absorbed by the inbox")

		var got string
		var version int
		require.NoError(t, pool.QueryRow(ctx, `select state, version from idemsaga.sagas where id = $1`, res.ID).Scan(&got, &version))
		require.Equal(t, state, got)
		require.Equal(t, step+2, version, "one transition per step")
	}

	var steps, commands, replies, ledger int
	require.NoError(t, pool.QueryRow(ctx, `select
  (select count(*) from idemsaga.steps where status = 'succeeded'),
  (select count(*) from idemsaga.outbox where subject like '%.cmd.%'),
  (select count(*) from idemsaga.outbox where subject like '%.reply.%'),
  (select count(*) from fixture.ledger)`).Scan(&steps, &commands, &replies, &ledger))
	require.Equal(t, []int{2, 2, 0, 2}, []int{steps, commands, replies, ledger},
		"two steps succeeded, two commands dispatched, no reply written, one ledger entry per step")
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"credited": 1}, rep.ByState)
}

// latestCommand decodes the newest command in the outbox.
func latestCommand(t *testing.T, pool *pgxpool.Pool) wire.Command {
	t.Helper()
	var payload []byte
	require.NoError(t, pool.QueryRow(context.Background(), `select payload from idemsaga.outbox where subject like '%.cmd.%' order by id desc limit 1`).Scan(&payload))
	cmd, err := wire.DecodeCommand(payload)
	require.NoError(t, err)
	return cmd
}

// TestSuccessNotAppliableInStepFallsBackToAReply: when the saga cannot take
// the success in the step's transaction (here its state was changed by
// hand), the step is rolled back and run again, answering with a reply as
// a worker without the engine's tables would. Its effect happens once.
func TestSuccessNotAppliableInStepFallsBackToAReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	_, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	stream := testenv.Name("FALLBACK")
	e := idleEngine(t, pool, nc, stream, nil, def)
	res, err := e.Client().Start(ctx, def, "fallback", transferInput(1, 2, 70))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.sagas set state = 'credited' where id = $1`, res.ID)
	require.NoError(t, err)

	reply, err := e.HandleCommand(ctx, latestCommand(t, pool))
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.False(t, reply.Duplicate)

	var replies, ledger, version int
	require.NoError(t, pool.QueryRow(ctx, `select
  (select count(*) from idemsaga.outbox where subject like '%.reply.%'),
  (select count(*) from fixture.ledger),
  (select version from idemsaga.sagas where id = $1)`, res.ID).Scan(&replies, &ledger, &version))
	require.Equal(t, []int{1, 1, 1}, []int{replies, ledger, version}, "one reply, one effect, the saga untouched")
}

// TestStaleSuccessInStepIsAnsweredByTheNextAttempt: attempt 1 succeeds
// after its lease was taken over. The takeover moved the saga's version,
// so its success cannot be applied in its step: it writes a reply, which
// the orchestrator finds stale. Its effect is in the inbox, though:
// attempt 2's delivery finds it there and applies it as its own success,
// in its step. One effect, nothing lost.
func TestStaleSuccessInStepIsAnsweredByTheNextAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	stream := testenv.Name("STALE")
	reg := prometheus.NewRegistry()
	e := idleEngine(t, pool, nc, stream, reg, def)
	res, err := e.Client().Start(ctx, def, "stale", transferInput(1, 2, 70))
	require.NoError(t, err)
	first := latestCommand(t, pool)

	// A worker claimed attempt 1 (claimed_attempt) and its lease ran out.
	_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second', claimed_attempt = attempt where saga_id = $1`, res.ID)
	require.NoError(t, err)
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, moved)
	second := latestCommand(t, pool)
	require.Equal(t, 2, second.Attempt)
	require.Equal(t, first.Version+1, second.Version, "the takeover bumped the saga's version")

	reply, err := e.HandleCommand(ctx, first)
	require.NoError(t, err)
	require.False(t, reply.Duplicate, "attempt 1 ran its handler")
	var state string
	require.NoError(t, pool.QueryRow(ctx, `select state from idemsaga.sagas where id = $1`, res.ID).Scan(&state))
	require.Equal(t, "init", state, "a stale success moves nothing")
	var payload []byte
	require.NoError(t, pool.QueryRow(ctx, `select payload from idemsaga.outbox where subject like '%.reply.%'`).Scan(&payload))
	r, err := wire.DecodeReply(payload)
	require.NoError(t, err)
	require.Equal(t, 1, r.Attempt)
	v, err := e.ApplyReply(ctx, r)
	require.NoError(t, err)
	require.Equal(t, engine.VerdictStale, v, "its reply is stale")

	reply, err = e.HandleCommand(ctx, second)
	require.NoError(t, err)
	require.True(t, reply.Duplicate, "attempt 2 finds attempt 1's effect in the inbox")
	require.NoError(t, pool.QueryRow(ctx, `select state from idemsaga.sagas where id = $1`, res.ID).Scan(&state))
	require.Equal(t, "deducted", state, "and applies it as its own success, in its step")

	// The credit, applied in its step, finishes the saga.
	_, err = e.HandleCommand(ctx, latestCommand(t, pool))
	require.NoError(t, err)
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"credited": 1}, rep.ByState)
}

// TestEnginePublishesWhatItCommits: with a hand-off of an hour, the relay's
// sweep cannot carry any message of this run, so every command must be
// published by the process that committed it, right after the commit.
// The transfers finish, and the outbox empties as the broker acknowledges.
func TestEnginePublishesWhatItCommits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded := seedForLoad(t, pool)
	e := startEngine(t, pool, nc, testenv.Name("PUBLISH"), []*saga.Definition{def}, func(c *engine.Config) { c.RelayHandOff = time.Hour })

	credited, compensated := submitTransfers(t, def, 60, e.Client())
	waitAllFinished(t, pool, time.Minute)
	requireAudit(t, pool, seeded, credited, compensated)
	var handedOff int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where publish_after is not null`).Scan(&handedOff))
	require.Zero(t, handedOff, "every handed-off row was published and deleted by its writer")
}

// TestReaperGivingUpWaitsForAStepInFlight: the last attempt's lease
// expires while its handler still runs: the reaper restarts it from the
// claim it sees, and when that lease expires too, its settle finds the
// step's key held (its advisory lock, tried without waiting), and changes
// nothing; the step then finishes and moves its saga on in its own
// transaction. Neither waits on the other, and nothing is logged as an
// error by PostgreSQL.
func TestReaperGivingUpWaitsForAStepInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	entered, release := make(chan struct{}), make(chan struct{})
	once := policyOnce()
	def, err := saga.New("slow",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Retry: once, Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			close(entered)
			<-release
			_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id) values ($1)`, sc.SagaID)
			return json.RawMessage(`"a"`), err
		}},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "done", Retry: once, Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, nil
		}})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `create table effects (saga_id uuid not null)`)
	require.NoError(t, err)
	stream := testenv.Name("INFLIGHT")
	e := idleEngine(t, pool, nc, stream, nil, def)
	res, err := e.Client().Start(ctx, def, "in-flight", map[string]int{"n": 1})
	require.NoError(t, err)
	cmd := latestCommand(t, pool)

	done := make(chan error, 1)
	go func() {
		_, err := e.HandleCommand(ctx, cmd)
		done <- err
	}()
	<-entered
	expire := func() {
		_, err := pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second' where saga_id = $1`, res.ID)
		require.NoError(t, err)
	}
	expire()
	moved, err := e.ReapOnce(ctx)
	if err != nil || moved != 1 {
		close(release)
	}
	require.NoError(t, err)
	require.Equal(t, 1, moved, "the attempt found running gets a lease from its claim")
	expire()
	moved, err = e.ReapOnce(ctx)
	if err != nil || moved != 0 {
		close(release)
	}
	require.NoError(t, err)
	require.Zero(t, moved, "the reaper leaves a step whose key is held")

	close(release)
	require.NoError(t, <-done)
	var state string
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `select (select state from idemsaga.sagas where id = $1), (select count(*) from effects)`, res.ID).Scan(&state, &effects))
	require.Equal(t, "a_done", state, "the step's success moved the saga on")
	require.Equal(t, 1, effects)
	moved, err = e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, moved, "nothing left to take over")
}

// policyOnce is one attempt with a long timeout.
func policyOnce() saga.RetryPolicy {
	p := fastPolicy
	p.MaxAttempts = 1
	return p
}

// TestMoveFailingInSQLRollsTheAttemptBack: the saga's writes fail inside
// PostgreSQL (a trigger refuses the transition), which aborts the step's
// transaction: nothing of the attempt commits, its effect included, and
// the command is to be delivered again. Once the trigger is gone, the next
// delivery runs the step once.
func TestMoveFailingInSQLRollsTheAttemptBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	var runs atomic.Int32
	def, err := saga.New("refused",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done", Retry: policyOnce(), Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			runs.Add(1)
			_, err := sc.Tx.Exec(ctx, `insert into effects (saga_id) values ($1)`, sc.SagaID)
			return json.RawMessage(`"a"`), err
		}},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "done", Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `create table effects (saga_id uuid not null);
create function refuse() returns trigger language plpgsql as $$
begin raise exception 'transition refused by a test trigger'; end $$;
create trigger refuse before update on idemsaga.sagas for each row when (new.state = 'a_done') execute function refuse()`)
	require.NoError(t, err)
	stream := testenv.Name("SQLFAIL")
	e := idleEngine(t, pool, nc, stream, nil, def)
	res, err := e.Client().Start(ctx, def, "sql-fail", map[string]int{"n": 1})
	require.NoError(t, err)
	cmd := latestCommand(t, pool)

	_, err = e.HandleCommand(ctx, cmd)
	require.ErrorContains(t, err, "transition refused by a test trigger")
	var effects, inbox, version int
	var status string
	count := func() {
		require.NoError(t, pool.QueryRow(ctx, `select
  (select count(*) from effects),
  (select count(*) from idemsaga.inbox),
  (select version from idemsaga.sagas where id = $1),
  (select status from idemsaga.steps where saga_id = $1 and step = 'a')`, res.ID).Scan(&effects, &inbox, &version, &status))
	}
	count()
	require.Equal(t, []int{0, 0, 1}, []int{effects, inbox, version}, "nothing of the attempt committed")
	require.Equal(t, "dispatched", status)

	_, err = pool.Exec(ctx, `drop trigger refuse on idemsaga.sagas`)
	require.NoError(t, err)
	reply, err := e.HandleCommand(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.False(t, reply.Duplicate)
	count()
	require.Equal(t, []int{1, 1, 2}, []int{effects, inbox, version}, "the redelivery ran the step once")
	require.Equal(t, "succeeded", status)
	require.Equal(t, int32(2), runs.Load(), "once per delivery")
}

// idleEngine returns an engine on stream that is not started: the test
// plays its step workers and reaper (HandleCommand, ReapOnce).
func idleEngine(t *testing.T, pool *pgxpool.Pool, nc *nats.Conn, stream string, reg prometheus.Registerer, def *saga.Definition) *engine.Engine {
	t.Helper()
	e, err := engine.New(engine.Config{
		Pool: pool, NATS: nc, Definitions: []*saga.Definition{def},
		Stream: stream, SubjectPrefix: "t." + stream, LeaseGrace: time.Hour,
		Logger: quietLogger(), Registerer: reg,
	})
	require.NoError(t, err)
	return e
}

// TestSuccessInStepFromWhatTheCommandSays: a success is applied in its
// step from the saga state and version its command carries, and the next
// command it writes carries the saga as committed. When the command is
// behind the saga (its version moved meanwhile) or carries no version, the
// success is answered with a reply instead, in the same transaction, and
// the orchestrator applies it after reading the saga. Each way: one
// effect, one transition.
func TestSuccessInStepFromWhatTheCommandSays(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// prepare changes the saga or the command before the delivery.
		prepare func(t *testing.T, pool *pgxpool.Pool, cmd *wire.Command)
		// version is the saga's after the success.
		version int64
		// replied is whether the success went by a reply.
		replied bool
	}{
		{"as written", func(*testing.T, *pgxpool.Pool, *wire.Command) {}, 2, false},
		{"saga moved meanwhile", func(t *testing.T, pool *pgxpool.Pool, cmd *wire.Command) {
			_, err := pool.Exec(context.Background(), `update idemsaga.sagas set version = version + 1 where id = $1`, cmd.SagaID)
			require.NoError(t, err)
		}, 3, true},
		{"carries no version", func(_ *testing.T, _ *pgxpool.Pool, cmd *wire.Command) {
			cmd.State, cmd.Version = "", 0
		}, 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			_, nc := testenv.NATS(t)
			def := transferDef(t)
			seeded, err := fixture.Seed(ctx, pool, 2, 1000)
			require.NoError(t, err)
			e := idleEngine(t, pool, nc, testenv.Name("GUESS"), nil, def)
			res, err := e.Client().Start(ctx, def, "guess", transferInput(1, 2, 70))
			require.NoError(t, err)
			cmd := latestCommand(t, pool)
			require.Equal(t, saga.StateInit, cmd.State)
			require.Equal(t, int64(1), cmd.Version)
			tc.prepare(t, pool, &cmd)

			reply, err := e.HandleCommand(ctx, cmd)
			require.NoError(t, err)
			require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
			require.False(t, reply.Duplicate)

			var payload []byte
			err = pool.QueryRow(ctx, `select payload from idemsaga.outbox where subject like '%.reply.%'`).Scan(&payload)
			if tc.replied {
				require.NoError(t, err, "the success went by a reply")
				r, err := wire.DecodeReply(payload)
				require.NoError(t, err)
				v, err := e.ApplyReply(ctx, r)
				require.NoError(t, err)
				require.Equal(t, engine.VerdictApplied, v)
			} else {
				require.ErrorIs(t, err, pgx.ErrNoRows, "the success needs no reply")
			}

			var state string
			var version int64
			var input []byte
			var results map[string]json.RawMessage
			require.NoError(t, pool.QueryRow(ctx, `select state, version, input, results from idemsaga.sagas where id = $1`, res.ID).Scan(&state, &version, &input, &results))
			require.Equal(t, "deducted", state)
			require.Equal(t, tc.version, version, "one transition")

			next := latestCommand(t, pool)
			require.Equal(t, fixture.StepCredit, next.Step)
			require.Equal(t, saga.State(state), next.State)
			require.Equal(t, version, next.Version, "the next command carries the saga as committed")
			require.JSONEq(t, string(input), string(next.Input))
			require.Len(t, next.Results, len(results))
			for k, v := range results {
				require.JSONEq(t, string(v), string(next.Results[k]), "result of %s", k)
			}

			_, err = e.HandleCommand(ctx, next)
			require.NoError(t, err)
			rep, err := fixture.Audit(ctx, pool, seeded)
			require.NoError(t, err)
			require.Empty(t, rep.Differences)
			require.Equal(t, map[string]int{"credited": 1}, rep.ByState)
		})
	}
}

// TestGuessedSuccessKeepsItsResultInTheStepRow: a success applied in its
// step as its command foresaw writes its result once, into the step's row,
// and leaves the inbox row's empty. Whoever reads the inbox gets it all the
// same: a duplicate delivery to another engine (no remembered answer)
// answers with it, and the step's compensation gets it as its forward
// result.
//
// Should neither row hold it (as an older step worker, which reads the
// inbox row alone, would see it), the compensation still gets the result
// its command carries from the saga.
func TestGuessedSuccessKeepsItsResultInTheStepRow(t *testing.T) {
	t.Parallel()
	for _, readable := range []bool{true, false} {
		t.Run(fmt.Sprintf("step row readable %v", readable), func(t *testing.T) {
			t.Parallel()
			guessedSuccessKeepsItsResult(t, readable)
		})
	}
}

func guessedSuccessKeepsItsResult(t *testing.T, readable bool) {
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	compensated := make(chan json.RawMessage, 1)
	def := saga.MustNew("kept",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done",
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return json.RawMessage(`{"took":42}`), nil
			},
			Compensate: func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				compensated <- sc.Results["a"]
				return nil, nil
			}},
		saga.Step{Kind: saga.DatabaseStep, Name: "b", Reaches: "b_done",
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.Permanent(errors.New("b refuses"))
			}},
	)
	reg := prometheus.NewRegistry()
	stream := testenv.Name("KEPT")
	e := idleEngine(t, pool, nc, stream, reg, def)
	res, err := e.Client().Start(ctx, def, "kept", map[string]int{})
	require.NoError(t, err)
	first := latestCommand(t, pool)
	_, err = e.HandleCommand(ctx, first)
	require.NoError(t, err)

	var inboxResult, stepResult []byte
	require.NoError(t, pool.QueryRow(ctx, `select i.result, st.result from idemsaga.inbox i
  join idemsaga.steps st on st.saga_id = i.saga_id and st.key = i.step_key
  where i.saga_id = $1 and st.step = 'a'`, res.ID).Scan(&inboxResult, &stepResult))
	require.Nil(t, inboxResult, "the result is written once")
	require.JSONEq(t, `{"took":42}`, string(stepResult))

	again, err := idleEngine(t, pool, nc, stream, prometheus.NewRegistry(), def).HandleCommand(ctx, first)
	require.NoError(t, err)
	require.True(t, again.Duplicate)
	require.JSONEq(t, `{"took":42}`, string(again.Result), "a duplicate answers with the result")

	// Step b fails for good: its failure, recorded in its step, moves the
	// saga to compensate a.
	_, err = e.HandleCommand(ctx, latestCommand(t, pool))
	require.NoError(t, err)
	comp := latestCommand(t, pool)
	require.Equal(t, saga.PhaseCompensate, comp.Phase)
	if !readable {
		_, err = pool.Exec(ctx, `update idemsaga.steps set result = null where saga_id = $1 and step = 'a'`, res.ID)
		require.NoError(t, err)
	}
	_, err = e.HandleCommand(ctx, comp)
	require.NoError(t, err)
	require.JSONEq(t, `{"took":42}`, string(<-compensated), "the compensation gets the forward result")
	var state string
	require.NoError(t, pool.QueryRow(ctx, `select state from idemsaga.sagas where id = $1`, res.ID).Scan(&state))
	require.Equal(t, string(saga.StateCompensated), state)
}

// TestDuplicateWaitingOnAGuessedSuccess: a second delivery that waits on
// the key while the first applies its success in its step, as its command
// foresaw, is answered with that success's result, which the first left in
// the step's row alone, committed in the same transaction as its inbox
// row.
func TestDuplicateWaitingOnAGuessedSuccess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	holding, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	def := saga.MustNew("waiting",
		saga.Step{Kind: saga.DatabaseStep, Name: "a", Reaches: "a_done",
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				if runs.Add(1) == 1 {
					close(holding)
					<-release
				}
				return json.RawMessage(`{"took":42}`), nil
			}},
	)
	stream := testenv.Name("WAITING")
	first, second := idleEngine(t, pool, nc, stream, prometheus.NewRegistry(), def), idleEngine(t, pool, nc, stream, prometheus.NewRegistry(), def)
	res, err := first.Client().Start(ctx, def, "waiting", map[string]int{})
	require.NoError(t, err)
	cmd := latestCommand(t, pool)

	done := make(chan error, 1)
	go func() {
		_, err := first.HandleCommand(ctx, cmd)
		done <- err
	}()
	<-holding
	answer := make(chan wire.Reply, 1)
	go func() {
		reply, err := second.HandleCommand(ctx, cmd)
		if err != nil {
			reply.Error = "handle: " + err.Error()
		}
		answer <- reply
	}()
	testenv.WaitForLockWaiters(t, pool, 1) // the second delivery waits on the key
	close(release)
	require.NoError(t, <-done)
	reply := <-answer
	require.Empty(t, reply.Error)
	require.True(t, reply.Duplicate)
	require.JSONEq(t, `{"took":42}`, string(reply.Result))
	require.Equal(t, int32(1), runs.Load(), "the handler ran once")
	var state string
	var inboxResult []byte
	require.NoError(t, pool.QueryRow(ctx, `select s.state, i.result from idemsaga.sagas s join idemsaga.inbox i on i.saga_id = s.id where s.id = $1`, res.ID).Scan(&state, &inboxResult))
	require.Equal(t, "a_done", state)
	require.Nil(t, inboxResult, "the success was applied as its command foresaw")
}

// TestSuccessOfAnAttemptWithARetryScheduled: attempt 1 of a step failed
// and its retry is scheduled (which bumps the saga's version), when
// another delivery of attempt 1 succeeds. The success cannot be applied as
// its command foresaw: it is answered with a reply, which the
// orchestrator applies (the success stops the retry), and the attempt's
// row in the timeline, written when the retry was scheduled, takes the
// success. The transfer then ends with one effect per step.
func TestSuccessOfAnAttemptWithARetryScheduled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 1000)
	require.NoError(t, err)
	e := idleEngine(t, pool, nc, testenv.Name("RETRYING"), nil, def)
	res, err := e.Client().Start(ctx, def, "retrying", transferInput(1, 2, 70))
	require.NoError(t, err)
	cmd := latestCommand(t, pool)

	failed := wire.Reply{SagaID: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step, Phase: cmd.Phase,
		Key: cmd.Key, Attempt: cmd.Attempt, Outcome: wire.OutcomeRetry, Error: "connection reset", RetryAfterMillis: time.Hour.Milliseconds()}
	v, err := e.ApplyReply(ctx, failed)
	require.NoError(t, err)
	require.Equal(t, engine.VerdictApplied, v)

	reply, err := e.HandleCommand(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, reply.Outcome)
	require.False(t, reply.Duplicate)
	applyReplies(t, e, pool)

	var state, status, outcome string
	var version, attempt, commands, replies int
	var finished bool
	require.NoError(t, pool.QueryRow(ctx, `select s.state, s.version, st.status, st.attempt,
  (select outcome from idemsaga.step_attempts a where a.saga_id = s.id and a.step = st.step and a.attempt = 1),
  (select finished_at is not null from idemsaga.step_attempts a where a.saga_id = s.id and a.step = st.step and a.attempt = 1),
  (select count(*) from idemsaga.outbox where subject like '%.cmd.%'),
  (select count(*) from idemsaga.outbox where subject like '%.reply.%')
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id and st.step = $2
where s.id = $1`, res.ID, cmd.Step).Scan(&state, &version, &status, &attempt, &outcome, &finished, &commands, &replies))
	require.Equal(t, []any{"deducted", 3, "succeeded", 1, "succeeded", true, 2, 1},
		[]any{state, version, status, attempt, outcome, finished, commands, replies},
		"the retry and the success each moved the saga's version once, the attempt's timeline row took the success, the next step is dispatched")

	// The next step runs as ever, and the transfer ends with one effect
	// per step.
	_, err = e.HandleCommand(ctx, latestCommand(t, pool))
	require.NoError(t, err)
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}

// applyReplies applies every reply in the outbox, as the orchestrator
// would, oldest first; replies applied already are judged duplicates.
func applyReplies(t *testing.T, e *engine.Engine, pool *pgxpool.Pool) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select payload from idemsaga.outbox where subject like '%.reply.%' order by id`)
	require.NoError(t, err)
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	for _, p := range payloads {
		r, err := wire.DecodeReply(p)
		require.NoError(t, err)
		_, err = e.ApplyReply(context.Background(), r)
		require.NoError(t, err)
	}
}

// TestSuccessRacingItsRetry: for each of several transfers, the reply that
// schedules attempt 1's retry and another delivery of attempt 1 that
// succeeds arrive at once, on two engines. Whichever commits first, the
// saga moves forward once, the step ends succeeded at attempt 1, an attempt row in
// the timeline (when the retry came first) carries the success, and each
// transfer ends with one effect per step.
func TestSuccessRacingItsRetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 2, 1_000_000)
	require.NoError(t, err)
	stream := testenv.Name("RACE")
	engines := []*engine.Engine{idleEngine(t, pool, nc, stream, nil, def), idleEngine(t, pool, nc, stream, nil, def)}

	const transfers = 12
	commandOf := func(id uuid.UUID) wire.Command {
		var payload []byte
		require.NoError(t, pool.QueryRow(ctx, `select payload from idemsaga.outbox where saga_id = $1 and subject like '%.cmd.%' order by id desc limit 1`, id).Scan(&payload))
		cmd, err := wire.DecodeCommand(payload)
		require.NoError(t, err)
		return cmd
	}
	ids := make([]uuid.UUID, transfers)
	for i := range ids {
		res, err := engines[0].Client().Start(ctx, def, fmt.Sprintf("race-%d", i), transferInput(1, 2, 5))
		require.NoError(t, err)
		ids[i] = res.ID
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*transfers)
	for i, id := range ids {
		cmd := commandOf(id)
		retry := wire.Reply{SagaID: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step, Phase: cmd.Phase,
			Key: cmd.Key, Attempt: cmd.Attempt, Outcome: wire.OutcomeRetry, Error: "connection reset", RetryAfterMillis: time.Hour.Milliseconds()}
		start := make(chan struct{})
		wg.Go(func() {
			<-start
			if _, err := engines[i%2].ApplyReply(ctx, retry); err != nil {
				errs <- fmt.Errorf("retry reply: %w", err)
			}
		})
		wg.Go(func() {
			<-start
			reply, err := engines[(i+1)%2].HandleCommand(ctx, cmd)
			switch {
			case err != nil:
				errs <- fmt.Errorf("delivery: %w", err)
			case reply.Outcome != wire.OutcomeSucceeded || reply.Duplicate:
				errs <- fmt.Errorf("delivery answered %s (duplicate %v)", reply.Outcome, reply.Duplicate)
			}
		})
		close(start)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// A success that lost the race to its retry went by a reply.
	applyReplies(t, engines[0], pool)

	for _, id := range ids {
		var state, status string
		var version, attempt, unfinished int
		require.NoError(t, pool.QueryRow(ctx, `select s.state, s.version, st.status, st.attempt,
  (select count(*) from idemsaga.step_attempts a where a.saga_id = s.id and a.step = st.step
     and (a.outcome is distinct from 'succeeded' or a.finished_at is null))
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id and st.step = 'deduct'
where s.id = $1`, id).Scan(&state, &version, &status, &attempt, &unfinished))
		require.Equal(t, []any{"deducted", "succeeded", 1, 0}, []any{state, status, attempt, unfinished},
			"saga %s: the step succeeded at attempt 1, no timeline row left open or at 'retry'", id)
		require.Contains(t, []int{2, 3}, version, "saga %s: one transition, and one version more when the retry came first", id)
		_, err := engines[0].HandleCommand(ctx, commandOf(id))
		require.NoError(t, err)
	}
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	require.Equal(t, map[string]int{"credited": transfers}, rep.ByState)
}
