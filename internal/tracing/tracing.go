// Package tracing is the engine's OpenTelemetry tracing: spans for starts,
// step attempts, compensations, replies and relay publishes, and the W3C
// trace context that carries one saga's trace through outbox rows and NATS
// headers.
//
// A nil *Tracer is tracing off: every method is then a no-op that
// allocates nothing, so callers need no checks of their own.
package tracing

import (
	"context"
	"net/http"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the engine's spans.
const ScopeName = "github.com/idemsaga/idemsaga"

// Span names.
const (
	SpanStart        = "idemsaga.start"
	SpanStep         = "idemsaga.step"
	SpanCompensation = "idemsaga.compensation"
	SpanReply        = "idemsaga.reply"
	SpanRedispatch   = "idemsaga.redispatch"
	SpanRepair       = "idemsaga.repair"
	SpanPublish      = "idemsaga.publish"
)

// Attribute keys. Spans may carry the saga id; metrics never do.
const (
	AttrSagaID     = attribute.Key("idemsaga.saga_id")
	AttrDefinition = attribute.Key("idemsaga.definition")
	AttrVersion    = attribute.Key("idemsaga.definition_version")
	AttrStep       = attribute.Key("idemsaga.step")
	AttrPhase      = attribute.Key("idemsaga.phase")
	AttrAttempt    = attribute.Key("idemsaga.attempt")
	AttrOutcome    = attribute.Key("idemsaga.outcome")
	AttrDuplicate  = attribute.Key("idemsaga.duplicate")
	AttrReason     = attribute.Key("idemsaga.reason")
	AttrRelay      = attribute.Key("idemsaga.relay")
	AttrSubject    = attribute.Key("messaging.destination.name")
	AttrMessageID  = attribute.Key("messaging.message.id")
	AttrSystem     = attribute.Key("messaging.system")
)

// Tracer makes the engine's spans. The zero of *Tracer (nil) traces
// nothing.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TraceContext
}

// New returns a tracer over tp, or nil (tracing off) when tp is nil.
func New(tp trace.TracerProvider) *Tracer {
	if tp == nil {
		return nil
	}
	return &Tracer{tracer: tp.Tracer(ScopeName)}
}

// Enabled reports whether t traces.
func (t *Tracer) Enabled() bool { return t != nil }

// Span is one span of the engine, or nothing when tracing is off. It is a
// value: ending it is safe on the zero Span.
type Span struct{ s trace.Span }

// SetAttributes adds attributes to the span.
func (s Span) SetAttributes(kv ...attribute.KeyValue) {
	if s.s != nil {
		s.s.SetAttributes(kv...)
	}
}

// End ends the span with outcome as its idemsaga.outcome (none if empty),
// and err, if not nil, recorded on it with an error status.
func (s Span) End(outcome string, err error) {
	if s.s == nil {
		return
	}
	if outcome != "" {
		s.s.SetAttributes(AttrOutcome.String(outcome))
	}
	if err != nil {
		s.s.RecordError(err)
		s.s.SetStatus(codes.Error, err.Error())
	}
	s.s.End()
}

// Recording reports whether the span records.
func (s Span) Recording() bool { return s.s != nil && s.s.IsRecording() }

// StartSaga starts the span of a saga's start, a child of ctx's span.
func (t *Tracer) StartSaga(ctx context.Context, definition string, version int) (context.Context, Span) {
	if t == nil {
		return ctx, Span{}
	}
	ctx, s := t.tracer.Start(ctx, SpanStart, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(AttrDefinition.String(definition), AttrVersion.Int(version)))
	return ctx, Span{s}
}

// Attempt names one attempt of one phase of one step of a saga.
type Attempt struct {
	Saga       uuid.UUID
	Definition string
	Step       string
	Phase      string
	Attempt    int
}

func (a Attempt) attributes() []attribute.KeyValue {
	return []attribute.KeyValue{AttrSagaID.String(a.Saga.String()), AttrDefinition.String(a.Definition),
		AttrStep.String(a.Step), AttrPhase.String(a.Phase), AttrAttempt.Int(a.Attempt)}
}

// StartAttempt starts the span of a step attempt (a compensation's when
// a's phase is "compensate"), a child of the trace context in carrier
// (the command's headers), or of ctx's span when carrier holds none.
func (t *Tracer) StartAttempt(ctx context.Context, carrier map[string]string, a Attempt) (context.Context, Span) {
	if t == nil {
		return ctx, Span{}
	}
	name := SpanStep
	if a.Phase == "compensate" {
		name = SpanCompensation
	}
	return t.startFrom(ctx, carrier, name, trace.SpanKindConsumer, a.attributes()...)
}

// StartReply starts the span of the orchestrator's handling of a reply to
// attempt a, a child of the trace context in carrier (the reply's
// headers).
func (t *Tracer) StartReply(ctx context.Context, carrier map[string]string, a Attempt) (context.Context, Span) {
	if t == nil {
		return ctx, Span{}
	}
	return t.startFrom(ctx, carrier, SpanReply, trace.SpanKindConsumer, a.attributes()...)
}

// StartRedispatch starts the span of the reaper's handling of attempt a
// (a due retry, an expired lease, a wait run out), a child of the saga's
// stored trace context (carrier).
func (t *Tracer) StartRedispatch(ctx context.Context, carrier map[string]string, a Attempt) (context.Context, Span) {
	if t == nil {
		return ctx, Span{}
	}
	return t.startFrom(ctx, carrier, SpanRedispatch, trace.SpanKindInternal, a.attributes()...)
}

// StartRepair starts the span of an operator's repair of a saga, or of a
// callback applied to it (what names it), a child of the saga's stored
// trace context (carrier).
func (t *Tracer) StartRepair(ctx context.Context, carrier map[string]string, sagaID uuid.UUID, definition, what string) (context.Context, Span) {
	if t == nil {
		return ctx, Span{}
	}
	return t.startFrom(ctx, carrier, SpanRepair, trace.SpanKindInternal,
		AttrSagaID.String(sagaID.String()), AttrDefinition.String(definition), AttrReason.String(what))
}

// startFrom starts span name, a child of the trace context in carrier, or
// of ctx's span when carrier holds none.
func (t *Tracer) startFrom(ctx context.Context, carrier map[string]string, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, Span) {
	ctx, s := t.tracer.Start(t.extract(ctx, carrier), name, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
	return ctx, Span{s}
}

// StartPublish starts the span of one outbox row's publish, a child of
// the trace context in msg's headers (the row's), and puts its own context
// in their place, so that the consumer's span is its child. A message
// that carries no trace context gets no span.
func (t *Tracer) StartPublish(msg *nats.Msg, msgID, relay string) Span {
	if t == nil || len(msg.Header) == 0 {
		return Span{}
	}
	c := NATSCarrier(msg.Header)
	ctx := t.prop.Extract(context.Background(), c)
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return Span{}
	}
	ctx, s := t.tracer.Start(ctx, SpanPublish, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		AttrSystem.String("nats"), AttrSubject.String(msg.Subject), AttrMessageID.String(msgID), AttrRelay.String(relay)))
	delete(msg.Header, tracestate)
	t.prop.Inject(ctx, c)
	return Span{s}
}

// Headers returns the trace context of ctx's span as message headers, nil
// when tracing is off or ctx holds no span.
func (t *Tracer) Headers(ctx context.Context) map[string]string {
	if t == nil || !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	h := make(map[string]string, 2)
	t.prop.Inject(ctx, propagation.MapCarrier(h))
	return h
}

// WithHeaders returns ctx with the remote span context in carrier as its
// parent, for spans of work done on behalf of a stored trace.
func (t *Tracer) WithHeaders(ctx context.Context, carrier map[string]string) context.Context {
	if t == nil {
		return ctx
	}
	return t.extract(ctx, carrier)
}

func (t *Tracer) extract(ctx context.Context, carrier map[string]string) context.Context {
	if len(carrier) == 0 {
		return ctx
	}
	return t.prop.Extract(ctx, propagation.MapCarrier(carrier))
}

// The W3C Trace Context headers.
const (
	traceparent = "traceparent"
	tracestate  = "tracestate"
)

// FromHTTP returns ctx with the remote span named by h's W3C traceparent
// (and tracestate) header as its parent, ctx itself when h names none.
func FromHTTP(ctx context.Context, h http.Header) context.Context {
	if h.Get(traceparent) == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, propagation.HeaderCarrier(h))
}

// FromNATS returns the trace context headers of a NATS message, nil when
// it carries none.
func FromNATS(h nats.Header) map[string]string {
	if len(h) == 0 {
		return nil
	}
	c := NATSCarrier(h)
	p := c.Get(traceparent)
	if p == "" {
		return nil
	}
	out := map[string]string{traceparent: p}
	if s := c.Get(tracestate); s != "" {
		out[tracestate] = s
	}
	return out
}

// NATSCarrier adapts nats.Header to propagation.TextMapCarrier. NATS
// headers are case-sensitive; the W3C keys are lower case.
type NATSCarrier nats.Header

var _ propagation.TextMapCarrier = NATSCarrier(nil)

// Get returns the first value of key.
func (c NATSCarrier) Get(key string) string {
	if v := c[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// Set sets key to value.
func (c NATSCarrier) Set(key, value string) { c[key] = []string{value} }

// Keys lists the keys.
func (c NATSCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
