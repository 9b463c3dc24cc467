package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestPauseRoutes pauses and resumes a saga and its definition over
// HTTP: a request sent again under its key replays, a second pause or a
// resume of what runs is refused, and an unknown definition is 404.
func TestPauseRoutes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := started(t, e.start(t, "p-saga", `{"account":4,"amount":40}`))
	saga := "/v1/sagas/" + s.ID.String()

	first := e.do(t, http.MethodPost, saga+"/pause", []hdr{jsonType(), key("pause-1")}, `{"reason":"bank down"}`)
	require.Equal(t, http.StatusOK, first.status, "body: %s", first.body)
	var rep httpapi.Repaired
	require.NoError(t, json.Unmarshal(first.body, &rep))
	require.Equal(t, "pause", rep.Operation)
	again := e.do(t, http.MethodPost, saga+"/pause", []hdr{jsonType(), key("pause-1")}, `{"reason":"bank down"}`)
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, string(first.body), string(again.body))
	twice := e.do(t, http.MethodPost, saga+"/pause", []hdr{key("pause-2")}, "")
	require.Equal(t, http.StatusConflict, twice.status, "body: %s", twice.body)
	require.Contains(t, twice.problem(t).Detail, "paused already")
	got := e.do(t, http.MethodGet, saga, nil, "")
	require.Contains(t, string(got.body), `"paused":{"since":`)
	resumed := e.do(t, http.MethodPost, saga+"/resume", []hdr{key("resume-1")}, "")
	require.Equal(t, http.StatusOK, resumed.status, "body: %s", resumed.body)
	require.Equal(t, http.StatusConflict, e.do(t, http.MethodPost, saga+"/resume", []hdr{key("resume-2")}, "").status)

	def := "/v1/definitions/payout"
	p := e.do(t, http.MethodPost, def+"/pause", []hdr{jsonType(), key("d-1")}, `{"reason":"bank down"}`)
	require.Equal(t, http.StatusOK, p.status, "body: %s", p.body)
	var dr engine.DefinitionRepair
	require.NoError(t, json.Unmarshal(p.body, &dr))
	require.Equal(t, []any{"payout", "pause", "d-1", false}, []any{dr.Definition, dr.Operation, dr.Key, dr.Replayed})
	require.Equal(t, http.StatusConflict, e.do(t, http.MethodPost, def+"/pause", []hdr{key("d-2")}, "").status)
	// The list says the definition is paused, and why.
	var defs httpapi.Definitions
	require.NoError(t, json.Unmarshal(e.do(t, http.MethodGet, "/v1/definitions", nil, "").body, &defs))
	require.Len(t, defs.Definitions, 1)
	require.NotNil(t, defs.Definitions[0].Paused)
	require.Equal(t, "bank down", defs.Definitions[0].Paused.Reason)
	require.Equal(t, "http", defs.Definitions[0].Paused.By)
	// A saga that finished is not held by the pause, though its
	// definition is paused.
	_, err := e.pool.Exec(context.Background(), `update idemsaga.sagas set finished_at = now(), state = 'compensated' where id = $1`, s.ID)
	require.NoError(t, err)
	got = e.do(t, http.MethodGet, saga, nil, "")
	require.Contains(t, string(got.body), `"paused":null`)
	reused := e.do(t, http.MethodPost, def+"/pause", []hdr{jsonType(), key("d-1")}, `{"reason":"other"}`)
	require.Equal(t, http.StatusUnprocessableEntity, reused.status)
	require.Equal(t, http.StatusOK, e.do(t, http.MethodPost, def+"/resume", []hdr{key("d-3")}, "").status)
	require.Equal(t, http.StatusConflict, e.do(t, http.MethodPost, def+"/resume", []hdr{key("d-4")}, "").status)
	require.NoError(t, json.Unmarshal(e.do(t, http.MethodGet, "/v1/definitions", nil, "").body, &defs))
	require.Nil(t, defs.Definitions[0].Paused)
	unknown := e.do(t, http.MethodPost, "/v1/definitions/nope/pause", []hdr{key("d-5")}, "")
	require.Equal(t, http.StatusNotFound, unknown.status)
	require.Equal(t, httpapi.ProblemUnknownDefinition, unknown.problem(t).Type)
	require.Equal(t, 0, e.count(t, `select count(*) from idemsaga.paused_definitions`))
}
