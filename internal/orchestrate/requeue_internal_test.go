package orchestrate

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/maintenance"
)

func TestPlanRequeue(t *testing.T) {
	t.Parallel()
	now := time.Now()
	const lease = 5 * time.Second
	stream := func(msgs uint64, oldest time.Duration) maintenance.Backlog {
		return maintenance.Backlog{Msgs: msgs, Oldest: now.Add(-oldest), At: now}
	}
	for _, c := range []struct {
		name   string
		queued time.Duration
		b      maintenance.Backlog
		known  bool
		want   requeuePlan
	}{
		{"stream unknown: the same id again", 6 * time.Second, maintenance.Backlog{}, false, requeuePlan{send: true, timer: lease, how: "resent"}},
		{"older messages wait: queued, the timer doubles", 12 * time.Second, stream(900, 20*time.Second), true, requeuePlan{timer: 12 * time.Second, how: "queued"}},
		{"queued long: the timer is bounded", 5 * time.Minute, stream(900, 6*time.Minute), true, requeuePlan{timer: requeueTimerMax, how: "queued"}},
		{"within the clocks' margin: queued", 6 * time.Second, stream(3, 5*time.Second), true, requeuePlan{timer: 6 * time.Second, how: "queued"}},
		{"the stream is younger: lost, a new id", 6 * time.Second, stream(3, time.Second), true, requeuePlan{send: true, msgSuffix: "-q6000", timer: lease, how: "resent", lost: true}},
		{"the stream is empty: lost", 6 * time.Second, stream(0, 0), true, requeuePlan{send: true, msgSuffix: "-q6000", timer: lease, how: "resent", lost: true}},
	} {
		require.Equal(t, c.want, planRequeue(lease, c.queued, c.b, c.known, now), c.name)
	}
}
