package engine_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestAnIdleReaperPassIsOneRoundTrip: an idle process makes a reaper pass
// every ReapInterval; one that finds nothing due costs a single round trip
// (it looks for due retries and expired leases together).
func TestAnIdleReaperPassIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testenv.DB(t)
	_, nc := testenv.NATS(t)
	pool, counted := testenv.CountRoundTrips(t, shared)
	e := idleEngine(t, pool, nc, testenv.Name("REAP"), prometheus.NewRegistry(), transferDef(t))
	require.NoError(t, pool.Ping(ctx)) // a connection made before counting

	counted.Reset()
	moved, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, moved)
	require.Equal(t, []int32{1, 0}, []int32{counted.Batches.Load(), counted.Alone.Load()}, "batches, statements alone")
}

// TestReaperLeavesOtherDefinitionsAlone: a step of a definition this
// engine does not run, whose lease expired, is left to the workers that
// have its code: the pass neither fails nor touches it.
func TestReaperLeavesOtherDefinitionsAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("OTHERS")
	other := saga.MustNew("other", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl := brokerClient(t, pool, stream, other)
	res, err := cl.Start(ctx, other, "o-1", map[string]int{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 hour' where saga_id = $1`, res.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `delete from idemsaga.outbox`)
	require.NoError(t, err)

	e := startEngine(t, pool, nc, stream, []*saga.Definition{transferDef(t)})
	n, err := e.ReapOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	var attempt int
	require.NoError(t, pool.QueryRow(ctx, `select attempt from idemsaga.steps where saga_id = $1`, res.ID).Scan(&attempt))
	require.Equal(t, 1, attempt, "not taken over by an engine without its code")
}

// TestReaperAppliesAnOutcomeWhoseReplyWasLost records a step's success
// in the inbox, loses its reply and its command (a worker that died
// between its outcome's commit and its reply's), and requires the reaper
// to apply the success from the inbox once the lease ran out: the saga
// goes on, under the same key, with no second effect.
func TestReaperAppliesAnOutcomeWhoseReplyWasLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def, err := fixture.Transfer(saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 5 * time.Millisecond, Timeout: time.Second})
	require.NoError(t, err)
	seeded, err := fixture.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	stream := testenv.Name("LOSTREPLY")
	reg := prometheus.NewRegistry()
	cfg := engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 500 * time.Millisecond, ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond, Logger: quietLogger(), Registerer: reg}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(ctx, cfg))
	res, err := e.Client().Start(ctx, def, "lost", transferInput(1, 2, 10))
	require.NoError(t, err)
	sg, err := e.Client().Get(ctx, res.ID)
	require.NoError(t, err)
	w := newReplyWorker(t, pool, "t."+stream, 0, def)
	r, err := w.Handle(ctx, wire.Command{SagaID: sg.ID, Definition: def.Name(), Step: fixture.StepDeduct, Phase: saga.PhaseForward,
		Key: saga.StepKey(sg.ID, fixture.StepDeduct, saga.PhaseForward), Attempt: 1, Input: sg.Input})
	require.NoError(t, err)
	require.Equal(t, wire.OutcomeSucceeded, r.Outcome)
	_, err = pool.Exec(ctx, `delete from idemsaga.outbox`) // the command and the reply, lost
	require.NoError(t, err)

	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(sctx))
	})
	done := waitState(t, e.Client(), sg.ID, fixture.StateCredited)
	require.Equal(t, 1, done.Steps[0].Attempt, "the deduct's one attempt stands")
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_commands_requeued_total", map[string]string{"how": "answered"}))
	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}
