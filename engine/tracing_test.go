package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
)

// process is one traced "process": a TracerProvider of its own with an
// in-memory exporter.
type process struct {
	name string
	exp  *tracetest.InMemoryExporter
	tp   *sdktrace.TracerProvider
}

func newProcess(t *testing.T, name string) *process {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &process{name: name, exp: exp, tp: tp}
}

func withTracer(tp trace.TracerProvider) engineOpt {
	return func(c *engine.Config) { c.TracerProvider = tp }
}

// spanOf is an ended span and the process that recorded it.
type spanOf struct {
	tracetest.SpanStub
	process string
}

func (s spanOf) attr(k attribute.Key) string {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value.String()
		}
	}
	return ""
}

// spans gathers what the processes recorded.
func spans(ps ...*process) []spanOf {
	var out []spanOf
	for _, p := range ps {
		for _, s := range p.exp.GetSpans() {
			out = append(out, spanOf{s, p.name})
		}
	}
	return out
}

// sagaSpans returns the spans of saga id: those that name it, and the
// publish spans of its trace.
func sagaSpans(all []spanOf, id uuid.UUID) []spanOf {
	var out []spanOf
	traces := map[trace.TraceID]bool{}
	for _, s := range all {
		if s.attr(tracing.AttrSagaID) == id.String() {
			out = append(out, s)
			traces[s.SpanContext.TraceID()] = true
		}
	}
	for _, s := range all {
		if s.Name == tracing.SpanPublish && traces[s.SpanContext.TraceID()] {
			out = append(out, s)
		}
	}
	return out
}

// requireOneTrace checks that the spans form one trace: one trace id,
// one root (the start), and every other span's parent among them.
func requireOneTrace(t *testing.T, ss []spanOf) map[trace.SpanID]spanOf {
	t.Helper()
	require.NotEmpty(t, ss)
	byID := map[trace.SpanID]spanOf{}
	for _, s := range ss {
		byID[s.SpanContext.SpanID()] = s
	}
	tid := ss[0].SpanContext.TraceID()
	roots := 0
	for _, s := range ss {
		require.Equal(t, tid, s.SpanContext.TraceID(), "span %s (%s) of process %s is in another trace", s.Name, s.attr(tracing.AttrStep), s.process)
		if !s.Parent.IsValid() {
			roots++
			require.Equal(t, tracing.SpanStart, s.Name, "only the start has no parent")
			continue
		}
		_, ok := byID[s.Parent.SpanID()]
		require.True(t, ok, "the parent of span %s (%s, attempt %s) of process %s was not recorded", s.Name, s.attr(tracing.AttrStep), s.attr(tracing.AttrAttempt), s.process)
	}
	require.Equal(t, 1, roots, "one root span per saga")
	return byID
}

func named(ss []spanOf, name string) []spanOf {
	var out []spanOf
	for _, s := range ss {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// threeSteps is a saga of three database steps whose second fails its
// first attempt with a retryable error, so its retry goes through a
// reply, the orchestrator and the reaper.
func threeSteps(t *testing.T, failLast bool) *saga.Definition {
	t.Helper()
	ok := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return json.RawMessage(`{}`), nil }
	undo := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	policy := saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, Jitter: -1, Timeout: 10 * time.Second}
	flaky := func(_ context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if sc.Attempt == 1 {
			return nil, errors.New("ledger busy")
		}
		return json.RawMessage(`{}`), nil
	}
	var last saga.HandlerFunc = ok
	if failLast {
		last = func(context.Context, *saga.StepContext) (json.RawMessage, error) {
			return nil, saga.Permanent(errors.New("card declined"))
		}
	}
	wrap := func(f saga.HandlerFunc) saga.HandlerFunc { return f }
	return saga.MustNew("traced",
		saga.Step{Kind: saga.DatabaseStep, Name: "reserve", Reaches: "reserved", Forward: wrap(ok), Compensate: wrap(undo), Retry: policy, CompensateRetry: policy},
		saga.Step{Kind: saga.DatabaseStep, Name: "debit", Reaches: "debited", Forward: wrap(flaky), Compensate: wrap(undo), Retry: policy, CompensateRetry: policy},
		saga.Step{Kind: saga.DatabaseStep, Name: "ship", Reaches: "shipped", Forward: wrap(last), Retry: policy},
	)
}

// tracedClient is a process that only starts sagas, with its own
// TracerProvider: its first commands reach the steps through another
// process's relay and the broker.
func tracedClient(t *testing.T, pool *pgxpool.Pool, stream string, p *process, def *saga.Definition) *engine.Client {
	t.Helper()
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, Logger: quietLogger(), TracerProvider: p.tp})
	require.NoError(t, err)
	return cl
}

func TestTracingOneTraceAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACE")
	def := threeSteps(t, false)
	starter, workerB, workerC := newProcess(t, "starter"), newProcess(t, "worker-b"), newProcess(t, "worker-c")
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, withTracer(workerB.tp))
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, withTracer(workerC.tp))
	cl := tracedClient(t, pool, stream, starter, def)

	const n = 6
	ids := make([]uuid.UUID, n)
	for i := range ids {
		res, err := cl.Start(ctx, def, key(i), map[string]int{"n": i})
		require.NoError(t, err)
		ids[i] = res.ID
	}
	waitAllFinished(t, pool, 30*time.Second)
	// The spans end after their commits: wait for the last ones.
	all := waitSpans(t, func(all []spanOf) bool {
		for _, id := range ids {
			if len(named(sagaSpans(all, id), tracing.SpanStep)) < 4 {
				return false
			}
		}
		return true
	}, starter, workerB, workerC)

	for _, id := range ids {
		ss := sagaSpans(all, id)
		byID := requireOneTrace(t, ss)
		start := named(ss, tracing.SpanStart)
		require.Len(t, start, 1)
		require.Equal(t, "starter", start[0].process)
		require.Equal(t, "started", start[0].attr(tracing.AttrOutcome))
		require.Equal(t, "traced", start[0].attr(tracing.AttrDefinition))

		// The first command crossed the broker: the relay's publish is
		// the start's child, and the first attempt the publish's.
		steps := named(ss, tracing.SpanStep)
		var first spanOf
		for _, s := range steps {
			if s.attr(tracing.AttrStep) == "reserve" {
				first = s
			}
		}
		require.NotEmpty(t, first.Name, "saga %s: no span of its first step", id)
		pub, ok := byID[first.Parent.SpanID()]
		require.True(t, ok)
		require.Equal(t, tracing.SpanPublish, pub.Name)
		require.Equal(t, trace.SpanKindProducer, pub.SpanKind)
		require.Equal(t, start[0].SpanContext.SpanID(), pub.Parent.SpanID())
		require.NotEqual(t, "starter", pub.process, "the starter runs no relay; a worker's published its command")

		// The flaky step: attempt 1 failed (its error recorded), its
		// reply applied by the orchestrator, the retry dispatched by the
		// reaper, attempt 2 succeeded.
		var debit []spanOf
		for _, s := range steps {
			if s.attr(tracing.AttrStep) == "debit" {
				debit = append(debit, s)
			}
		}
		outcomes := map[string]string{}
		for _, s := range debit {
			outcomes[s.attr(tracing.AttrAttempt)] = s.attr(tracing.AttrOutcome)
			require.Equal(t, id.String(), s.attr(tracing.AttrSagaID))
			require.Equal(t, "forward", s.attr(tracing.AttrPhase))
			if s.attr(tracing.AttrAttempt) == "1" {
				require.Equal(t, codes.Error, s.Status.Code)
				require.NotEmpty(t, s.Events, "the attempt's error is recorded on its span")
			}
		}
		require.Equal(t, "retry", outcomes["1"])
		require.Equal(t, "succeeded", outcomes["2"])
		require.NotEmpty(t, named(ss, tracing.SpanReply), "saga %s: the orchestrator's handling of the retry has a span", id)
		redispatch := named(ss, tracing.SpanRedispatch)
		require.NotEmpty(t, redispatch, "saga %s: the reaper's retry has a span", id)
		require.Equal(t, "retry due", redispatch[0].attr(tracing.AttrReason))
		require.Equal(t, start[0].SpanContext.SpanID(), redispatch[0].Parent.SpanID(), "the reaper continues from the saga's recorded start")
	}
	// The spans of all three processes took part.
	seen := map[string]bool{}
	for _, s := range all {
		seen[s.process] = true
	}
	require.True(t, seen["starter"])
	require.True(t, seen["worker-b"] || seen["worker-c"])
}

// waitSpans waits until done holds for the spans the processes recorded.
func waitSpans(t *testing.T, done func([]spanOf) bool, ps ...*process) []spanOf {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		all := spans(ps...)
		if done(all) {
			return all
		}
		if time.Now().After(deadline) {
			t.Fatalf("spans not all recorded in time: %d spans", len(all))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestTracingCompensation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACEC")
	def := threeSteps(t, true)
	p := newProcess(t, "worker")
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, withTracer(p.tp))
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	waitState(t, e.Client(), res.ID, saga.StateCompensated)

	all := waitSpans(t, func(all []spanOf) bool { return len(named(sagaSpans(all, res.ID), tracing.SpanCompensation)) >= 2 }, p)
	ss := sagaSpans(all, res.ID)
	requireOneTrace(t, ss)
	ship := []spanOf{}
	for _, s := range named(ss, tracing.SpanStep) {
		if s.attr(tracing.AttrStep) == "ship" {
			ship = append(ship, s)
		}
	}
	require.Len(t, ship, 1)
	require.Equal(t, "failed", ship[0].attr(tracing.AttrOutcome))
	require.Equal(t, codes.Error, ship[0].Status.Code)
	comp := named(ss, tracing.SpanCompensation)
	require.Len(t, comp, 2, "debit and reserve are compensated")
	steps := map[string]bool{}
	for _, s := range comp {
		require.Equal(t, "compensate", s.attr(tracing.AttrPhase))
		require.Equal(t, "succeeded", s.attr(tracing.AttrOutcome))
		steps[s.attr(tracing.AttrStep)] = true
	}
	require.Equal(t, map[string]bool{"debit": true, "reserve": true}, steps)
}

// headerTap records the trace headers of every message on the
// deployment's subjects.
type headerTap struct {
	mu      sync.Mutex
	msgs    int
	traced  int
	parents map[string]bool
}

func tap(t *testing.T, nc *nats.Conn, stream string) *headerTap {
	t.Helper()
	h := &headerTap{parents: map[string]bool{}}
	sub, err := nc.Subscribe("t."+stream+".>", func(m *nats.Msg) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.msgs++
		if p := m.Header.Get("traceparent"); p != "" {
			h.traced++
			h.parents[p] = true
		}
	})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	return h
}

func (h *headerTap) counts() (msgs, traced int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.msgs, h.traced
}

func TestTracingOffRecordsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACEOFF")
	def := threeSteps(t, true)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def})
	h := tap(t, nc, stream)
	// A caller that traces itself: an engine without a TracerProvider
	// neither joins its trace nor passes it on.
	caller := newProcess(t, "caller")
	cctx, sp := caller.tp.Tracer("caller").Start(ctx, "request")
	cl := brokerClient(t, pool, stream, def)
	var ids []uuid.UUID
	for i := range 3 {
		res, err := cl.Start(cctx, def, key(i), map[string]int{})
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	sp.End()
	waitAllFinished(t, pool, 30*time.Second)
	for _, id := range ids {
		sg, err := e.Client().Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, saga.StateCompensated, sg.State)
	}
	var traced int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where trace_context is not null`).Scan(&traced))
	require.Zero(t, traced, "no saga records a trace context")
	// Every start's command, a retry's reply and command, crossed the
	// broker: none carried trace headers.
	require.Eventually(t, func() bool { msgs, _ := h.counts(); return msgs >= 2*len(ids) }, 10*time.Second, 10*time.Millisecond)
	msgs, withTrace := h.counts()
	require.Zero(t, withTrace, "%d of %d messages carried trace headers", withTrace, msgs)
	require.Len(t, caller.exp.GetSpans(), 1, "only the caller's own span")
}

func TestTracingHeadersOnTheWire(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACEON")
	def := threeSteps(t, false)
	p := newProcess(t, "worker")
	startEngine(t, pool, nc, stream, []*saga.Definition{def}, withTracer(p.tp))
	h := tap(t, nc, stream)
	cl := tracedClient(t, pool, stream, newProcess(t, "starter"), def)
	res, err := cl.Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	waitAllFinished(t, pool, 30*time.Second)
	var recorded map[string]string
	require.NoError(t, pool.QueryRow(ctx, `select trace_context from idemsaga.sagas where id = $1`, res.ID).Scan(&recorded))
	require.NotEmpty(t, recorded["traceparent"], "the start's context is recorded with the saga")
	require.Eventually(t, func() bool { msgs, _ := h.counts(); return msgs >= 2 }, 10*time.Second, 10*time.Millisecond)
	msgs, withTrace := h.counts()
	require.Equal(t, msgs, withTrace, "every message of a traced saga carries its trace context")
}

func TestTracingDuplicateAndRedeliveredCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACEDUP")
	def := threeSteps(t, false)
	p := newProcess(t, "worker")
	faults := &attempt.Faults{}
	// A copy of the first step's command goes to a second runner, and the
	// third step's worker dies after its commit, before its ack: the
	// command comes again and is answered from the inbox.
	faults.Add(attempt.Fault{Kind: attempt.DeliverTwice, Step: "reserve"})
	faults.Add(attempt.Fault{Kind: attempt.CrashAfterCommit, Step: "ship"})
	cfg := engine.Config{
		Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, ReapInterval: 20 * time.Millisecond,
		RelayPollInterval: 20 * time.Millisecond, RelayHandOff: time.Second, Logger: quietLogger(), TracerProvider: p.tp,
	}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(ctx, cfg))
	require.NoError(t, e.Start(testhook.With(ctx, &testhook.Hooks{Faults: faults})))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(sctx))
	})
	starter := newProcess(t, "starter")
	cl := tracedClient(t, pool, stream, starter, def)
	res, err := cl.Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	waitState(t, e.Client(), res.ID, "shipped")
	require.Equal(t, 1, faults.Fired(attempt.DeliverTwice))
	require.Equal(t, 1, faults.Fired(attempt.CrashAfterCommit))

	all := waitSpans(t, func(all []spanOf) bool {
		ss := sagaSpans(all, res.ID)
		dups := 0
		for _, s := range named(ss, tracing.SpanStep) {
			if s.attr(tracing.AttrOutcome) == "duplicate" {
				dups++
			}
		}
		return dups >= 1 && len(named(ss, tracing.SpanStep)) >= 6
	}, p, starter)
	ss := sagaSpans(all, res.ID)
	requireOneTrace(t, ss)
	perStep := map[string]int{}
	for _, s := range named(ss, tracing.SpanStep) {
		perStep[s.attr(tracing.AttrStep)]++
	}
	require.GreaterOrEqual(t, perStep["reserve"], 2, "the copy of the first command has its own span in the saga's trace")
	require.GreaterOrEqual(t, perStep["ship"], 2, "the redelivered command has its own span in the saga's trace")
}

func TestTracingRepairContinuesTheSagasTrace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("TRACEREP")
	var undoFails sync.Map
	undoFails.Store("on", true)
	policy := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond, Jitter: -1, Timeout: 10 * time.Second}
	def := saga.MustNew("traced-repair",
		saga.Step{Kind: saga.DatabaseStep, Name: "reserve", Reaches: "reserved", Retry: policy, CompensateRetry: policy,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				if _, on := undoFails.Load("on"); on {
					return nil, saga.Permanent(errors.New("warehouse offline"))
				}
				return nil, nil
			}},
		saga.Step{Kind: saga.DatabaseStep, Name: "ship", Reaches: "shipped", Retry: policy,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.Permanent(errors.New("no courier"))
			}},
	)
	p := newProcess(t, "worker")
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def}, withTracer(p.tp))
	res, err := e.Client().Start(ctx, def, "k", map[string]int{})
	require.NoError(t, err)
	waitState(t, e.Client(), res.ID, saga.StateFailed)

	undoFails.Delete("on")
	_, err = e.Client().Retry(ctx, res.ID, engine.Repair{Key: "r1", Reason: "warehouse back", By: "test"})
	require.NoError(t, err)
	waitState(t, e.Client(), res.ID, saga.StateCompensated)

	all := waitSpans(t, func(all []spanOf) bool {
		ok := 0
		for _, s := range named(sagaSpans(all, res.ID), tracing.SpanCompensation) {
			if s.attr(tracing.AttrOutcome) == "succeeded" {
				ok++
			}
		}
		return ok == 1 && len(named(sagaSpans(all, res.ID), tracing.SpanRepair)) == 1
	}, p)
	ss := sagaSpans(all, res.ID)
	byID := requireOneTrace(t, ss)
	repair := named(ss, tracing.SpanRepair)[0]
	for _, s := range named(ss, tracing.SpanCompensation) {
		if s.attr(tracing.AttrOutcome) == "succeeded" {
			require.Equal(t, repair.SpanContext.SpanID(), s.Parent.SpanID(), "the retried compensation is the repair's child")
		}
	}
	require.Equal(t, tracing.SpanStart, byID[repair.Parent.SpanID()].Name, "the repair continues from the saga's start")
}
