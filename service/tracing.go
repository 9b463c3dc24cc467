package service

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// tracingWanted reports whether the standard OpenTelemetry environment
// asks for traces: an exporter other than none, or an OTLP endpoint; and
// OTEL_SDK_DISABLED=true not set.
func tracingWanted(getenv func(string) string) bool {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return false
	}
	if e := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); e != "" {
		return !strings.EqualFold(e, "none")
	}
	return getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// newTracerProvider builds the SDK TracerProvider of `run` from the
// standard OTEL_* environment when tracing is asked for (tracingWanted),
// and returns nil, tracing off, otherwise. The exporter is
// OTEL_TRACES_EXPORTER's (otlp by default, over OTEL_EXPORTER_OTLP_PROTOCOL;
// console), batched as OTEL_BSP_* say; the sampler is OTEL_TRACES_SAMPLER's
// (parentbased_always_on by default); the resource names the service
// serviceName unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say
// otherwise. Shut it down to flush the spans in hand.
func newTracerProvider(ctx context.Context, serviceName string, log *slog.Logger) (*sdktrace.TracerProvider, error) {
	if !tracingWanted(os.Getenv) {
		return nil, nil
	}
	sampler := strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER"))
	if sampler != "" && !knownSamplers[sampler] {
		return nil, fmt.Errorf("tracing: OTEL_TRACES_SAMPLER=%q is not a sampler: use one of always_on, always_off, traceidratio, parentbased_always_on (the default), parentbased_always_off, parentbased_traceidratio", sampler)
	}
	if sampler == "" {
		sampler = "parentbased_always_on"
	}
	exp, err := autoexport.NewSpanExporter(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: the OTEL_TRACES_EXPORTER (%q) / OTEL_EXPORTER_OTLP_* environment does not make an exporter (otlp and console are; unset them, or set OTEL_SDK_DISABLED=true, to run without tracing): %w", os.Getenv("OTEL_TRACES_EXPORTER"), err)
	}
	res, err := traceResource(ctx, serviceName)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, fmt.Errorf("tracing: OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME is malformed (give key=value pairs separated by commas): %w", err)
	}
	log.Info("tracing on", "exporter", exporterName(), "sampler", sampler)
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// shutdownTracing flushes the spans tp holds (nil: tracing off), within
// 10 s: called after a drain, so that the spans of the last work go out.
func shutdownTracing(tp *sdktrace.TracerProvider, log *slog.Logger) {
	if tp == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		log.Warn("tracing: spans not all exported at stop", "error", err)
	}
}

// traceResource is the resource of the spans: service.name serviceName,
// unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES give another, and
// the attributes they give.
func traceResource(ctx context.Context, serviceName string) (*resource.Resource, error) {
	return resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", serviceName)),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
}

// knownSamplers are the OTEL_TRACES_SAMPLER values the SDK understands; it
// would only log another and take its default.
var knownSamplers = map[string]bool{
	"always_on": true, "always_off": true, "traceidratio": true,
	"parentbased_always_on": true, "parentbased_always_off": true, "parentbased_traceidratio": true,
}

func exporterName() string {
	if e := os.Getenv("OTEL_TRACES_EXPORTER"); e != "" {
		return e
	}
	return "otlp"
}
