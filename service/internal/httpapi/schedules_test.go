package httpapi_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestScheduleRoutes lists the schedules, pauses and resumes one (a
// request sent again under its key replays), and lists the event dead
// letters.
func TestScheduleRoutes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var list httpapi.Schedules
	got := e.do(t, http.MethodGet, "/v1/schedules", nil, "")
	require.Equal(t, http.StatusOK, got.status)
	require.JSONEq(t, `{"schedules":[]}`, string(got.body))
	missing := e.do(t, http.MethodPost, "/v1/schedules/payout/pause", []hdr{key("s-0")}, "")
	require.Equal(t, http.StatusNotFound, missing.status, "body: %s", missing.body)
	require.Equal(t, httpapi.ProblemScheduleNotFound, missing.problem(t).Type)

	// As the first engine that runs a schedule records it.
	e.count(t, `with i as (insert into idemsaga.schedules (definition, cron, last_tick) values ('payout', '@hourly', '2030-01-01T12:30:00Z') returning 1) select count(*) from i`)
	p := e.do(t, http.MethodPost, "/v1/schedules/payout/pause", []hdr{jsonType(), key("s-1")}, `{"reason":"bank holiday"}`)
	require.Equal(t, http.StatusOK, p.status, "body: %s", p.body)
	var rep engine.ScheduleRepair
	require.NoError(t, json.Unmarshal(p.body, &rep))
	require.Equal(t, []any{"payout", "pause", "s-1", false}, []any{rep.Definition, rep.Operation, rep.Key, rep.Replayed})
	again := e.do(t, http.MethodPost, "/v1/schedules/payout/pause", []hdr{jsonType(), key("s-1")}, `{"reason":"bank holiday"}`)
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, http.StatusConflict, e.do(t, http.MethodPost, "/v1/schedules/payout/pause", []hdr{key("s-2")}, "").status)
	reused := e.do(t, http.MethodPost, "/v1/schedules/payout/resume", []hdr{jsonType(), key("s-1")}, `{"reason":"bank holiday"}`)
	require.Equal(t, http.StatusUnprocessableEntity, reused.status)
	require.Equal(t, http.StatusBadRequest, e.do(t, http.MethodPost, "/v1/schedules/payout/resume", nil, "").status, "an Idempotency-Key is required")

	got = e.do(t, http.MethodGet, "/v1/schedules", nil, "")
	require.NoError(t, json.Unmarshal(got.body, &list))
	require.Len(t, list.Schedules, 1)
	require.Equal(t, "bank holiday", list.Schedules[0].Paused.Reason)
	require.Equal(t, "2030-01-01T13:00:00Z", list.Schedules[0].Next.Format("2006-01-02T15:04:05Z07:00"))
	require.Equal(t, http.StatusOK, e.do(t, http.MethodPost, "/v1/schedules/payout/resume", []hdr{key("s-3")}, "").status)
	require.Equal(t, http.StatusConflict, e.do(t, http.MethodPost, "/v1/schedules/payout/resume", []hdr{key("s-4")}, "").status)

	e.count(t, `with i as (insert into idemsaga.event_dead_letters (definition, stream, stream_seq, subject, payload, reason, deliveries, parked_by)
values ('payout', 'BANK', 3, 'bank.payouts', '{"x":1}', 'the message has no Nats-Msg-Id header', 1, 'test') returning 1) select count(*) from i`)
	dl := e.do(t, http.MethodGet, "/v1/event-dead-letters?definition=payout", nil, "")
	require.Equal(t, http.StatusOK, dl.status, "body: %s", dl.body)
	var dls httpapi.EventDeadLetters
	require.NoError(t, json.Unmarshal(dl.body, &dls))
	require.Len(t, dls.EventDeadLetters, 1)
	require.Equal(t, "the message has no Nats-Msg-Id header", dls.EventDeadLetters[0].Reason)
	require.Equal(t, http.StatusBadRequest, e.do(t, http.MethodGet, "/v1/event-dead-letters?limit=0", nil, "").status)
}
