package engine_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestTwoServicesOnOneStream: two services, each running its own
// definition, share one stream and one database. Every command reaches a
// process that runs its definition at once: no step waits out a lease,
// none is parked, and neither service's workers are given the other's
// commands or replies.
func TestTwoServicesOnOneStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TWOSVC")
	l := newLedger()
	alpha := saga.MustNew("alpha", dbStep("a1", "a1ed", l.step(1, "a1", nil, false), fastPolicy), dbStep("a2", "a2ed", l.step(1, "a2", nil, false), fastPolicy))
	beta := saga.MustNew("beta", dbStep("b1", "b1ed", l.step(1, "b1", nil, false), fastPolicy), dbStep("b2", "b2ed", l.step(1, "b2", nil, false), fastPolicy))
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	startEngine(t, pool, nc, stream, []*saga.Definition{alpha}, func(c *engine.Config) { c.Registerer = regA })
	startEngine(t, pool, nc, stream, []*saga.Definition{beta}, func(c *engine.Config) { c.Registerer = regB })

	// Started by a process that runs neither (a web tier), so that every
	// command goes through the stream.
	cl := brokerClient(t, pool, stream, alpha, beta)
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		for _, def := range []*saga.Definition{alpha, beta} {
			wg.Go(func() {
				_, err := cl.Start(ctx, def, fmt.Sprintf("%s-%d", def.Name(), i), map[string]int{"n": i})
				require.NoError(t, err)
			})
		}
	}
	wg.Wait()
	waitAllFinished(t, pool, 2*time.Minute)

	var attempts []int
	rows, err := pool.Query(ctx, `select distinct attempt from idemsaga.steps`)
	require.NoError(t, err)
	for rows.Next() {
		var a int
		require.NoError(t, rows.Scan(&a))
		attempts = append(attempts, a)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []int{1}, attempts, "every step ran at its first attempt: none waited out a lease")
	require.Equal(t, 2*n, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas where state in ('a2ed', 'b2ed')`))
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.dead_letters`))
	for _, c := range []struct {
		reg       *prometheus.Registry
		runs, not string
	}{{regA, "alpha", "beta"}, {regB, "beta", "alpha"}} {
		require.Zero(t, metricSum(t, c.reg, "idemsaga_step_attempts_total", map[string]string{"definition": c.not}), "%s's workers were given %s's commands", c.runs, c.not)
		require.Zero(t, metricSum(t, c.reg, "idemsaga_lease_takeovers_total", nil))
		require.Zero(t, metricSum(t, c.reg, "idemsaga_dead_letters_parked_total", nil))
		require.Zero(t, metricSum(t, c.reg, "idemsaga_commands_handed_back_total", nil), "no command reached a worker that does not run it")
	}
	var p50, worst float64
	require.NoError(t, pool.QueryRow(ctx, `select percentile_cont(0.5) within group (order by extract(epoch from finished_at - created_at)),
		max(extract(epoch from finished_at - created_at)) from idemsaga.sagas`).Scan(&p50, &worst))
	t.Logf("%d sagas of two services on one stream: start to end p50 %.3f s, longest %.3f s", 2*n, p50, worst)
}

// TestRetiresTheConsumerOfEveryDefinition: the consumers an earlier
// release made, of every definition's commands and replies, are deleted
// when an engine starts (its messages stay in the stream for the
// consumers of their definitions), and cannot be made again beside the
// consumers of definitions.
func TestRetiresTheConsumerOfEveryDefinition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("RETIRE")
	prefix := "t." + stream
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Retention: jetstream.WorkQueuePolicy})
	require.NoError(t, err)
	legacy := map[string]string{stream + "_steps": prefix + ".cmd.>", stream + "_orchestrator": prefix + ".reply.>"}
	for name, filter := range legacy {
		_, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy})
		require.NoError(t, err)
	}
	l := newLedger()
	def := saga.MustNew("solo", dbStep("x", "xed", l.step(1, "x", nil, false), fastPolicy))
	startEngine(t, pool, nc, stream, []*saga.Definition{def})

	var names []string
	for n := range s.ConsumerNames(ctx).Name() {
		names = append(names, n)
	}
	slices.Sort(names)
	require.Equal(t, []string{stream + "_orchestrator_solo", stream + "_steps_solo"}, names)
	for name, filter := range legacy {
		_, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckExplicitPolicy})
		require.Error(t, err, "a process of the earlier release cannot take every definition's messages again")
	}
	sg, err := brokerClient(t, pool, stream, def).Start(ctx, def, "solo-1", map[string]int{"n": 1})
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	got, err := brokerClient(t, pool, stream, def).Wait(wctx, sg.ID)
	require.NoError(t, err)
	require.Equal(t, saga.State("xed"), got.State)
	require.Equal(t, 1, got.Steps[0].Attempt)
}
