package schedule_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/schedule"
	"github.com/idemsaga/idemsaga/saga"
)

func TestDueKeepsTheLatestTicksAndCountsTheRest(t *testing.T) {
	t.Parallel()
	c, err := saga.ParseCron("*/5 * * * *")
	require.NoError(t, err)
	last := time.Date(2030, 1, 1, 12, 2, 0, 0, time.UTC)
	at := func(m int) time.Time { return time.Date(2030, 1, 1, 12, m, 0, 0, time.UTC) }

	require.Empty(t, schedule.Due(c, last, at(4), 0).Start, "nothing due before the first tick")
	w := schedule.Due(c, last, at(5), 0)
	require.Equal(t, []time.Time{at(5)}, w.Start, "a tick is due at its time")
	require.Zero(t, w.Skipped)

	for catchUp := range 14 {
		w := schedule.Due(c, last, at(59), catchUp)
		// Ticks at :05 to :55, eleven of them.
		n := min(catchUp+1, 11)
		require.Len(t, w.Start, n)
		require.Equal(t, at(55), w.Start[n-1], "the latest due tick always starts")
		require.Equal(t, 11-n, w.Skipped)
		for i := 1; i < n; i++ {
			require.True(t, w.Start[i-1].Before(w.Start[i]), "oldest first")
		}
		if w.Skipped > 0 {
			require.Equal(t, w.Start[0].Add(-5*time.Minute), w.LastSkipped)
		} else {
			require.True(t, w.LastSkipped.IsZero())
		}
	}
}
