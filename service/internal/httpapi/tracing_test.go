package httpapi_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

func TestStartContinuesTheRequestsTrace(t *testing.T) {
	t.Parallel()
	const (
		traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
		spanID  = "00f067aa0ba902b7"
	)
	for _, follow := range []bool{true, false} {
		exp := tracetest.NewInMemoryExporter()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		pool := testenv.DB(t)
		cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{payout}, Logger: quietLogger(), TracerProvider: tp})
		require.NoError(t, err)
		e := serve(t, pool, cl, func(c *httpapi.Config) { c.TraceRequests = follow })
		r := e.do(t, http.MethodPost, "/v1/sagas/payout", append(startHeaders("T-1"), hdr{"traceparent", "00-" + traceID + "-" + spanID + "-01"}), `{"account":1,"amount":5}`)
		require.Equal(t, http.StatusCreated, r.status)
		id := started(t, r).ID

		spans := exp.GetSpans()
		require.Len(t, spans, 1)
		start := spans[0]
		require.Equal(t, tracing.SpanStart, start.Name)
		var recorded map[string]string
		require.NoError(t, pool.QueryRow(context.Background(), `select trace_context from idemsaga.sagas where id = $1`, id).Scan(&recorded))
		require.Contains(t, recorded["traceparent"], start.SpanContext.SpanID().String(), "the saga records its start's context")
		if follow {
			require.Equal(t, traceID, start.SpanContext.TraceID().String(), "the start joins the caller's trace")
			require.Equal(t, spanID, start.Parent.SpanID().String())
		} else {
			require.NotEqual(t, traceID, start.SpanContext.TraceID().String())
			require.False(t, start.Parent.IsValid())
		}
	}
}
