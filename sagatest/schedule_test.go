package sagatest_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// TestScheduleRunsOnTheKitsClock: a nightly schedule ticks when the test
// moves the clock past 02:00, once per night, however often the engine
// looks.
func TestScheduleRunsOnTheKitsClock(t *testing.T) {
	t.Parallel()
	type settle struct {
		Night string `json:"night"`
	}
	def := saga.WithSchedule(saga.WithInput(saga.MustNew("settlement", saga.Step{
		Name: "settle", Reaches: "settled", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
	}), func(settle) error { return nil }), saga.Schedule{
		Cron:      "0 2 * * *",
		InputFunc: func(tick time.Time) (any, error) { return settle{Night: tick.Format("2006-01-02")}, nil },
	})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()

	first := env.Tick(t, def)
	require.Equal(t, saga.State("settled"), first.State)
	var in settle
	require.NoError(t, json.Unmarshal(first.Input, &in))
	require.Equal(t, first.Key, saga.TickKey(mustParseDay(t, in.Night).Add(2*time.Hour)))

	// Another night: one more saga, under the next night's key.
	require.NoError(t, env.Clock.Advance(ctx, 24*time.Hour))
	next := saga.TickKey(mustParseDay(t, in.Night).Add(26 * time.Hour))
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := env.Client.GetByKey(ctx, "settlement", next); err == nil {
			break
		}
		require.False(t, time.Now().After(deadline), "no saga for %s", next)
		time.Sleep(2 * time.Millisecond)
	}
	var n int
	require.NoError(t, env.Pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = 'settlement'`).Scan(&n))
	require.Equal(t, 2, n, "one saga per night")
}

func mustParseDay(t *testing.T, day string) time.Time {
	t.Helper()
	d, err := time.Parse("2006-01-02", day)
	require.NoError(t, err)
	return d
}

// TestTickAfterTheClockPassedTicks moves the clock past three nights
// before the engine looks, then asks for the next tick: Tick moves on to
// the first night after the clock's now, and does not wait for a night
// the catch-up policy skipped.
func TestTickAfterTheClockPassedTicks(t *testing.T) {
	t.Parallel()
	def := saga.WithSchedule(saga.MustNew("nightly", saga.Step{
		Name: "settle", Reaches: "settled", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
	}), saga.Schedule{Cron: "0 2 * * *"})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	ctx := context.Background()
	first := env.Tick(t, def)
	require.NoError(t, env.Clock.Advance(ctx, 3*24*time.Hour+time.Hour))
	now, err := env.Clock.Now(ctx)
	require.NoError(t, err)
	next := env.Tick(t, def)
	require.Equal(t, saga.State("settled"), next.State)
	require.True(t, next.CreatedAt.After(first.CreatedAt))
	c, err := saga.ParseCron("0 2 * * *")
	require.NoError(t, err)
	require.Equal(t, saga.TickKey(c.Next(now)), next.Key, "the first night after the clock's now")
}
