package httpapi

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// TestStatsOfMissing: a gauge that no collector answered (the broker out
// of reach) is null, and the counters of nothing are 0 and {}, so a
// client reads every member.
func TestStatsOfMissing(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	finished := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idemsaga_sagas_finished_total"}, []string{"definition", "outcome"})
	other := prometheus.NewCounter(prometheus.CounterOpts{Name: "other_sagas_started_total"})
	reg.MustRegister(finished, other)
	finished.WithLabelValues("a", "completed").Add(2)
	finished.WithLabelValues("b", "completed").Add(3)
	finished.WithLabelValues("b", "parked").Inc()
	other.Add(7)
	families, err := reg.Gather()
	require.NoError(t, err)
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	b, err := json.Marshal(statsOf(families, at))
	require.NoError(t, err)
	require.JSONEq(t, `{"at":"2026-01-02T03:04:05Z","sagas_started":0,"sagas_finished":{"completed":5,"parked":1},"step_attempts":{},
"duplicates_absorbed":{},"deliveries":{},"lease_takeovers":0,"retries_scheduled":0,
"stream_messages":null,"stream_oldest_message_seconds":null,"stream_queued_messages":null,"stream_oldest_queued_seconds":null,"outbox_backlog_rows":null,"outbox_oldest_unpublished_seconds":null}`, string(b))
}
