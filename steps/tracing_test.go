package steps_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// TestTracedWorkerContinuesTheCommandsTrace: a stand-alone worker with a
// TracerProvider of its own runs a command as a child of the trace its
// headers carry, and its reply carries the attempt's span.
func TestTracedWorkerContinuesTheCommandsTrace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := effectsDB(t)
	policy := saga.RetryPolicy{MaxAttempts: 3, Timeout: 10 * time.Second}
	def := saga.MustNew("traced", saga.Step{Name: "write", Reaches: "written", Kind: saga.DatabaseStep, Retry: policy,
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			return nil, writeEffect(ctx, sc)
		}})
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(ctx) })
	w, _ := meteredWorker(t, pool, def, func(c *steps.Config) { c.TracerProvider = tp })

	// The orchestrator's side, another process.
	other := tracetest.NewInMemoryExporter()
	otp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(other))
	t.Cleanup(func() { _ = otp.Shutdown(ctx) })
	tr := tracing.New(otp)
	sctx, start := tr.StartSaga(ctx, "traced", 1)
	id := testenv.NewSaga(t, pool, "traced")
	cmd := testenv.Command(id, "traced", "write", saga.PhaseForward, 1, map[string]int{})
	cmd.Trace = tr.Headers(sctx)
	start.End("started", nil)

	reply, err := w.Handle(ctx, cmd)
	require.NoError(t, err)
	require.Equal(t, "succeeded", string(reply.Outcome))
	again, err := w.HandleRedelivered(ctx, cmd)
	require.NoError(t, err)
	require.True(t, again.Duplicate)

	spans := exp.GetSpans()
	require.Len(t, spans, 2, "the attempt and its redelivery")
	parent := other.GetSpans()[0].SpanContext
	for _, s := range spans {
		require.Equal(t, tracing.SpanStep, s.Name)
		require.Equal(t, parent.TraceID(), s.SpanContext.TraceID())
		require.Equal(t, parent.SpanID(), s.Parent.SpanID())
	}
	var headers map[string]string
	require.NoError(t, pool.QueryRow(ctx, `select headers from idemsaga.outbox where saga_id = $1 and subject like '%.reply.%' order by id limit 1`, pguuid.Of(id)).Scan(&headers))
	require.Contains(t, headers["traceparent"], spans[0].SpanContext.SpanID().String(), "the reply carries the attempt's span")
}
