package tracing

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func recorder(t *testing.T) (*Tracer, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return New(tp), exp
}

func TestNilTracerDoesNothingAndAllocatesNothing(t *testing.T) {
	// Not parallel: AllocsPerRun counts the whole process's allocations.
	var tr *Tracer
	require.Nil(t, New(nil))
	require.False(t, tr.Enabled())
	ctx := context.Background()
	a := Attempt{Saga: uuid.New(), Definition: "d", Step: "s", Phase: "forward", Attempt: 1}
	msg := nats.NewMsg("x")
	allocs := testing.AllocsPerRun(100, func() {
		c, sp := tr.StartSaga(ctx, "d", 1)
		sp.End("started", nil)
		c, sp = tr.StartAttempt(c, nil, a)
		sp.End("succeeded", nil)
		_, sp = tr.StartReply(c, nil, a)
		sp.End("applied", nil)
		tr.StartPublish(msg, "id", "sweep").End("published", nil)
		if tr.Headers(c) != nil {
			panic("headers without tracing")
		}
	})
	require.Zero(t, allocs)
	// SetAttributes's arguments escape: callers set attributes only on
	// a tracer that is enabled.
}

func TestContextTravelsThroughHeadersAndPublish(t *testing.T) {
	t.Parallel()
	tr, exp := recorder(t)
	ctx, start := tr.StartSaga(context.Background(), "transfer", 2)
	h := tr.Headers(ctx)
	require.NotEmpty(t, h["traceparent"])
	start.End("started", nil)

	// The relay publishes the row's headers with its own span's context.
	msg := nats.NewMsg("idemsaga.cmd.transfer.debit")
	for k, v := range h {
		msg.Header.Set(k, v)
	}
	msg.Header.Set("Other", "kept")
	pub := tr.StartPublish(msg, "c-1", "sweep")
	require.True(t, pub.Recording())
	pub.End("published", nil)
	require.Equal(t, "kept", msg.Header.Get("Other"))
	require.NotEqual(t, h["traceparent"], msg.Header.Get("traceparent"))

	// The worker continues from what the message carries.
	a := Attempt{Saga: uuid.New(), Definition: "transfer", Step: "debit", Phase: "compensate", Attempt: 3}
	_, step := tr.StartAttempt(context.Background(), FromNATS(msg.Header), a)
	step.End("failed", errors.New("insufficient funds"))

	spans := exp.GetSpans()
	require.Len(t, spans, 3)
	s, p, c := spans[0], spans[1], spans[2]
	require.Equal(t, SpanStart, s.Name)
	require.Equal(t, SpanPublish, p.Name)
	require.Equal(t, trace.SpanKindProducer, p.SpanKind)
	require.Equal(t, SpanCompensation, c.Name, "a compensate phase names the span")
	require.Equal(t, s.SpanContext.SpanID(), p.Parent.SpanID())
	require.Equal(t, p.SpanContext.SpanID(), c.Parent.SpanID())
	require.True(t, c.Parent.IsRemote())
	require.Equal(t, s.SpanContext.TraceID(), c.SpanContext.TraceID())
	require.Equal(t, codes.Error, c.Status.Code)
	require.Len(t, c.Events, 1, "the error is recorded")
}

func TestPublishWithoutTraceContextHasNoSpan(t *testing.T) {
	t.Parallel()
	tr, exp := recorder(t)
	msg := nats.NewMsg("x")
	msg.Header.Set("Nats-Msg-Id", "c-1")
	require.False(t, tr.StartPublish(msg, "c-1", "sweep").Recording())
	msg.Header.Set("traceparent", "not a trace context")
	tr.StartPublish(msg, "c-1", "sweep").End("", nil)
	require.Empty(t, exp.GetSpans())
	require.Nil(t, FromNATS(nats.Header{"Other": {"x"}}))
}
