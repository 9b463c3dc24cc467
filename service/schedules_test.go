package service

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestSchedulesCommands: list the schedules, pause one (safe to send
// again under its key), resume it; a definition without a schedule is
// named in the error.
func TestSchedulesCommands(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	ctx := context.Background()
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	out, _, err := runIn(t, admin, "schedules")
	require.NoError(t, err)
	require.Contains(t, out, "0 schedules")
	// As the first engine that runs a schedule records it.
	_, err = pool.Exec(ctx, `insert into idemsaga.schedules (definition, cron, last_tick) values ('greet', '0 2 * * *', '2030-01-01T12:00:00Z')`)
	require.NoError(t, err)

	out, _, err = runIn(t, admin, "schedules", "list")
	require.NoError(t, err)
	require.Regexp(t, `greet +0 2 \* \* \* +- +2030-01-02T02:00:00Z +-`, out)
	out, _, err = runIn(t, admin, "schedules", "pause", "greet", "--reason", "year end", "--by", "ann", "--request-key", "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "schedule of greet: paused")
	out, _, err = runIn(t, admin, "schedules", "pause", "greet", "--reason", "year end", "--by", "ann", "--request-key", "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "already paused by this request (key p-1)")
	_, _, err = runIn(t, admin, "schedules", "pause", "greet")
	require.ErrorIs(t, err, engine.ErrStateForbids)
	out, _, err = runIn(t, admin, "schedules", "--json")
	require.NoError(t, err)
	var list []engine.ScheduleInfo
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	require.Len(t, list, 1)
	require.NotNil(t, list[0].Paused)
	require.Equal(t, "cli:ann", list[0].Paused.By)
	require.Equal(t, "year end", list[0].Paused.Reason)
	out, _, err = runIn(t, admin, "schedules", "resume", "greet")
	require.NoError(t, err)
	require.Contains(t, out, "schedule of greet: resumed")
	_, _, err = runIn(t, admin, "schedules", "resume", "nope")
	require.ErrorIs(t, err, engine.ErrScheduleNotFound)
}

// TestEventDeadLettersCommands: list the events that could not start a
// saga, and drop them.
func TestEventDeadLettersCommands(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	ctx := context.Background()
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `insert into idemsaga.event_dead_letters (definition, stream, stream_seq, subject, payload, reason, deliveries, parked_by)
values ('greet', 'SHOP', 7, 'shop.greet', '{}', 'the message has no Nats-Msg-Id header', 1, 'test') returning id`).Scan(&id))
	out, _, err := runIn(t, admin, "events")
	require.NoError(t, err)
	require.Regexp(t, `greet +SHOP +7 +shop.greet +- `, out)
	require.Contains(t, out, "no Nats-Msg-Id header")
	require.Contains(t, out, "1 event dead letters")
	out, _, err = runIn(t, admin, "events", "drop", "1")
	require.NoError(t, err)
	require.Contains(t, out, "dropped 1 event dead letters: 1")
	_, _, err = runIn(t, admin, "events", "drop", "1")
	require.ErrorIs(t, err, engine.ErrDeadLetterNotFound)
}
