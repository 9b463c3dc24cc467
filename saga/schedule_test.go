package saga_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func TestWithScheduleRefusesInvalidSchedules(t *testing.T) {
	t.Parallel()
	base := saga.MustNew("nightly", step("a", "a_done"))
	for _, tc := range []struct {
		name  string
		s     saga.Schedule
		field string
	}{
		{"empty cron", saga.Schedule{}, "Schedule.Cron"},
		{"not cron", saga.Schedule{Cron: "every night"}, "Schedule.Cron"},
		{"six fields", saga.Schedule{Cron: "0 0 2 * * *"}, "Schedule.Cron"},
		{"every second", saga.Schedule{Cron: "@every 10s"}, "Schedule.Cron"},
		{"unknown zone", saga.Schedule{Cron: "CRON_TZ=Mars/Olympus 0 2 * * *"}, "Schedule.Cron"},
		{"negative catch-up", saga.Schedule{Cron: "@daily", CatchUp: -1}, "Schedule.CatchUp"},
		{"flood", saga.Schedule{Cron: "@daily", CatchUp: saga.ScheduleCatchUpMax + 1}, "Schedule.CatchUp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.ErrorIs(t, tc.s.Validate(), saga.ErrInvalidDefinition)
			defer func() {
				r := recover()
				err, ok := r.(error)
				require.True(t, ok, "WithSchedule panics with an error, got %v", r)
				var de *saga.DefinitionError
				require.True(t, errors.As(err, &de))
				require.Equal(t, tc.field, de.Field)
				require.Equal(t, "nightly", de.Definition)
				require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			}()
			saga.WithSchedule(base, tc.s)
		})
	}
}

func TestScheduleIsUTCAndDescribed(t *testing.T) {
	t.Parallel()
	base := saga.MustNew("nightly", step("a", "a_done"))
	d := saga.WithSchedule(base, saga.Schedule{Cron: "0 2 * * *", CatchUp: 3})
	_, had := base.Schedule()
	require.False(t, had, "WithSchedule returns a copy")
	s, ok := d.Schedule()
	require.True(t, ok)
	require.Equal(t, 3, s.CatchUp)

	c, err := saga.ParseCron(s.Cron)
	require.NoError(t, err)
	from := time.Date(2030, 1, 1, 12, 0, 0, 0, time.FixedZone("UTC+5", 5*3600))
	require.Equal(t, time.Date(2030, 1, 2, 2, 0, 0, 0, time.UTC), c.Next(from).UTC(), "a cron without a zone is read in UTC")
	paris, err := saga.ParseCron("CRON_TZ=Europe/Paris 0 2 * * *")
	require.NoError(t, err)
	require.Equal(t, time.Date(2030, 1, 2, 1, 0, 0, 0, time.UTC), paris.Next(from).UTC())
	require.Equal(t, "tick:2030-01-02T02:00:00Z", saga.TickKey(c.Next(from)))

	desc := d.Describe()
	require.Equal(t, &saga.ScheduleDescription{Cron: "0 2 * * *", CatchUp: 3, Input: "tick"}, desc.Schedule)
	require.NotEqual(t, base.Describe().Fingerprint(), desc.Fingerprint(), "processes must agree on the schedule")
	withFunc := saga.WithSchedule(base, saga.Schedule{Cron: "0 2 * * *", CatchUp: 3, InputFunc: func(time.Time) (any, error) { return nil, nil }})
	require.Equal(t, "func", withFunc.Describe().Schedule.Input)
	back, err := saga.FromDescription(desc)
	require.NoError(t, err)
	require.Equal(t, desc.Fingerprint(), back.Describe().Fingerprint())
	require.Nil(t, base.Describe().Schedule, "a definition without a schedule describes none")
}
