package service

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
)

func TestTracingWantedFromEnvironment(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  map[string]string
		want bool
	}{
		{nil, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "none"}, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, true},
		{map[string]string{"OTEL_SERVICE_NAME": "payments"}, false},
	} {
		got := tracingWanted(func(k string) string { return tc.env[k] })
		require.Equal(t, tc.want, got, "environment %v", tc.env)
	}
}

func TestTracerProviderFromEnvironment(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	t.Setenv("OTEL_TRACES_EXPORTER", "")
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	tp, err := newTracerProvider(ctx, "worker", log)
	require.NoError(t, err)
	require.Nil(t, tp, "no OTEL_* environment: no tracing at all")

	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	t.Setenv("OTEL_SERVICE_NAME", "payments")
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
	t.Setenv("OTEL_TRACES_SAMPLER", "always_off")
	tp, err = newTracerProvider(ctx, "worker", log)
	require.NoError(t, err)
	require.NotNil(t, tp)
	_, sp := tp.Tracer("t").Start(ctx, "x")
	require.False(t, sp.IsRecording(), "OTEL_TRACES_SAMPLER is honoured")
	sp.End()
	require.NoError(t, tp.Shutdown(ctx))
	res := resourceOf(t)
	require.Contains(t, res, attribute.String("service.name", "payments"))
	require.Contains(t, res, attribute.String("deployment.environment", "test"))

	t.Setenv("OTEL_SERVICE_NAME", "")
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "")
	require.Contains(t, resourceOf(t), attribute.String("service.name", "worker"), "the service's name by default")

	t.Setenv("OTEL_TRACES_EXPORTER", "carrier-pigeon")
	_, err = newTracerProvider(ctx, "worker", log)
	require.ErrorContains(t, err, "OTEL_SDK_DISABLED=true")
	require.ErrorContains(t, err, `"carrier-pigeon"`, "the error names the value")

	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	t.Setenv("OTEL_TRACES_SAMPLER", "bogus")
	_, err = newTracerProvider(ctx, "worker", log)
	require.ErrorContains(t, err, `OTEL_TRACES_SAMPLER="bogus" is not a sampler`)
}

func resourceOf(t *testing.T) []attribute.KeyValue {
	t.Helper()
	res, err := traceResource(context.Background(), "worker")
	require.NoError(t, err)
	return res.Attributes()
}
