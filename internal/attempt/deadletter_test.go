package attempt

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestDeadLetterPolicy: the defaults wait 10s, 30s, 90s and 120s between
// five deliveries (about four minutes); waits grow threefold up to the
// maximum.
func TestDeadLetterPolicy(t *testing.T) {
	t.Parallel()
	p := DeadLetterPolicy{}.withDefaults()
	require.Equal(t, 5, p.Deliveries)
	var waits []time.Duration
	var total time.Duration
	for d := 1; d < p.Deliveries; d++ {
		waits = append(waits, p.delay(d))
		total += p.delay(d)
	}
	require.Equal(t, []time.Duration{10 * time.Second, 30 * time.Second, 90 * time.Second, 2 * time.Minute}, waits)
	require.Equal(t, 250*time.Second, total)
	require.Equal(t, 2*time.Minute, p.delay(100), "no overflow past the maximum")

	short := DeadLetterPolicy{Deliveries: 3, Backoff: time.Millisecond}.withDefaults()
	require.Equal(t, time.Millisecond, short.delay(1))
	require.Equal(t, 3*time.Millisecond, short.delay(2))
}
