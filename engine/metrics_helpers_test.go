package engine_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// metricSum adds up every sample of a counter or gauge family whose labels include
// the given ones.
func metricSum(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	total := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metric:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue metric
				}
			}
			if c := m.GetCounter(); c != nil {
				total += c.GetValue()
			}
			if g := m.GetGauge(); g != nil {
				total += g.GetValue()
			}
		}
	}
	return total
}

// stepDuplicates is the duplicate commands the step side absorbed: by a
// worker remembering the attempt, or by the inbox.
func stepDuplicates(t testing.TB, reg *prometheus.Registry) float64 {
	t.Helper()
	return metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "inbox"}) +
		metricSum(t, reg, "idemsaga_duplicates_absorbed_total", map[string]string{"layer": "recent"})
}

// waitStepsRan waits up to 30 s for the attempts that ran a handler (every
// attempt counted, less the duplicates absorbed) to reach want: an attempt
// is counted once its outcome committed, which can follow a read of the
// saga it moved.
func waitStepsRan(t testing.TB, reg *prometheus.Registry, want float64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := metricSum(t, reg, "idemsaga_step_attempts_total", nil) - stepDuplicates(t, reg)
		if got >= want {
			return
		}
		require.False(t, time.Now().After(deadline), "%v attempts ran a handler after 30 s, want %v", got, want)
		time.Sleep(5 * time.Millisecond)
	}
}
