package httpapi

import (
	"net/http"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/idemsaga/idemsaga/internal/metrics"
)

// ProblemStatsUnavailable: GET /v1/stats was asked of a server mounted
// without Config.Gatherer (501).
const ProblemStatsUnavailable = "urn:idemsaga:problem:stats-unavailable"

// Stats is the body of GET /v1/stats: this process's cumulative counters
// as of At, read from the engine's metrics, and the backlog gauges. A
// client computes rates from two answers: (b.X - a.X) / (b.At - a.At).
// Counters restart from 0 when the process restarts, and count only this
// process's work; /metrics of every worker, summed, is the deployment's.
type Stats struct {
	// At is when the figures were read, on this server's clock.
	At time.Time `json:"at"`
	// SagasStarted counts sagas this process created (a start answered
	// as a duplicate is not counted).
	SagasStarted int64 `json:"sagas_started"`
	// SagasFinished counts sagas that reached a terminal state here, by
	// outcome: completed, compensated, failed, parked.
	SagasFinished map[string]int64 `json:"sagas_finished"`
	// StepAttempts counts step attempts run here, by outcome.
	StepAttempts map[string]int64 `json:"step_attempts"`
	// Duplicates counts duplicates absorbed, by layer (start, broker,
	// recent, inbox, orchestrator, callback).
	Duplicates map[string]int64 `json:"duplicates_absorbed"`
	// Deliveries counts what each layer saw: start requests (start),
	// outbox rows published (broker), step commands handled (inbox),
	// step replies handled (orchestrator), callbacks received (callback).
	// A layer's hit rate is Duplicates[layer] / Deliveries[layer], except
	// recent's: recent and inbox check the same step commands in turn (a
	// command the worker remembers is answered before the inbox), so both
	// are shares of Deliveries["inbox"], and there is no "recent" entry.
	Deliveries map[string]int64 `json:"deliveries"`
	// LeaseTakeovers counts steps whose lease expired without a reply.
	LeaseTakeovers int64 `json:"lease_takeovers"`
	// RetriesScheduled counts step retries after a retryable failure.
	RetriesScheduled int64 `json:"retries_scheduled"`
	// StreamMessages is the number of messages in the engine's JetStream
	// stream, null when the stream could not be read.
	StreamMessages *float64 `json:"stream_messages"`
	// StreamOldestSeconds is the age of the stream's oldest message (0
	// when empty), null when the stream could not be read.
	StreamOldestSeconds *float64 `json:"stream_oldest_message_seconds"`
	// StreamQueuedMessages is the number of the stream's messages no
	// worker was given yet, null when it could not be read.
	StreamQueuedMessages *float64 `json:"stream_queued_messages"`
	// StreamOldestQueuedSeconds is the age of the oldest of them (0 when
	// none): load shedding compares it with its bound.
	StreamOldestQueuedSeconds *float64 `json:"stream_oldest_queued_seconds"`
	// OutboxBacklogRows is the number of outbox rows not yet published,
	// null when the database could not be read.
	OutboxBacklogRows *float64 `json:"outbox_backlog_rows"`
	// OutboxOldestSeconds is the age of the oldest unpublished outbox
	// row (0 when none), null when the database could not be read.
	OutboxOldestSeconds *float64 `json:"outbox_oldest_unpublished_seconds"`
}

// stats handles GET /v1/stats.
func (a *api) stats(w http.ResponseWriter, r *http.Request) {
	if a.cfg.Gatherer == nil {
		writeProblem(w, newProblem(http.StatusNotImplemented, ProblemStatsUnavailable, "Stats unavailable",
			"this server was mounted without the engine's metrics registry (httpapi.Config.Gatherer); read /metrics instead, or give the API the Registerer the engine uses"))
		return
	}
	families, err := a.cfg.Gatherer.Gather()
	if err != nil && len(families) == 0 {
		a.internal(w, r, "read the engine's metrics", "retry later", err)
		return
	}
	// A failed collector (the database out of reach, say) leaves its
	// figures null, which the answer shows; the others are still worth
	// answering. /readyz and /metrics report the failure itself.
	if err != nil {
		a.cfg.Logger.DebugContext(r.Context(), "http api: some metrics could not be read for /v1/stats", "error", err)
	}
	a.encode(w, r, http.StatusOK, statsOf(families, time.Now().UTC()))
}

// statsOf reads a Stats from gathered metric families.
func statsOf(families []*dto.MetricFamily, at time.Time) Stats {
	s := Stats{At: at, SagasFinished: map[string]int64{}, StepAttempts: map[string]int64{},
		Duplicates: map[string]int64{}, Deliveries: map[string]int64{}}
	byLabel := func(into map[string]int64, label string, f *dto.MetricFamily) {
		for _, m := range f.GetMetric() {
			into[labelOf(m, label)] += int64(m.GetCounter().GetValue())
		}
	}
	sum := func(f *dto.MetricFamily) int64 {
		var n int64
		for _, m := range f.GetMetric() {
			n += int64(m.GetCounter().GetValue())
		}
		return n
	}
	gauge := func(f *dto.MetricFamily) *float64 {
		ms := f.GetMetric()
		if len(ms) == 0 {
			return nil
		}
		v := ms[0].GetGauge().GetValue()
		return &v
	}
	for _, f := range families {
		name, ok := strings.CutPrefix(f.GetName(), metrics.Namespace+"_")
		if !ok {
			continue
		}
		switch name {
		case "sagas_started_total":
			s.SagasStarted = sum(f)
		case "sagas_finished_total":
			byLabel(s.SagasFinished, "outcome", f)
		case "step_attempts_total":
			byLabel(s.StepAttempts, "outcome", f)
		case "duplicates_absorbed_total":
			byLabel(s.Duplicates, "layer", f)
		case "deliveries_total":
			byLabel(s.Deliveries, "layer", f)
		case "lease_takeovers_total":
			s.LeaseTakeovers = sum(f)
		case "retries_scheduled_total":
			s.RetriesScheduled = sum(f)
		case "stream_messages":
			s.StreamMessages = gauge(f)
		case "stream_oldest_message_seconds":
			s.StreamOldestSeconds = gauge(f)
		case "stream_queued_messages":
			s.StreamQueuedMessages = gauge(f)
		case "stream_oldest_queued_seconds":
			s.StreamOldestQueuedSeconds = gauge(f)
		case "outbox_backlog_rows":
			s.OutboxBacklogRows = gauge(f)
		case "outbox_oldest_unpublished_seconds":
			s.OutboxOldestSeconds = gauge(f)
		}
	}
	return s
}

func labelOf(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}
