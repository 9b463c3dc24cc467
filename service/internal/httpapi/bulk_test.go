package httpapi_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestSkipCloseAndShow: a skip replays under its key and is shown by
// GET; a close the state forbids is refused; bad bodies change nothing.
func TestSkipCloseAndShow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := started(t, e.start(t, "s-1", `{"account":4,"amount":40}`))
	path := "/v1/sagas/" + s.ID.String() + "/skip"
	body := `{"step":"reserve","result":{"booked":0},"reason":"booked by hand"}`

	for _, c := range []struct {
		name, body, detail string
	}{
		{"no body", ``, "not a JSON object"},
		{"no step", `{"result":1}`, `"step" is missing`},
		{"unknown member", `{"step":"reserve","by":"me"}`, `"by"`},
		{"case twin", `{"STEP":"reserve"}`, `"STEP"`},
		{"twice", `{"step":"reserve","step":"book"}`, "twice"},
		{"duplicate in result", `{"step":"reserve","result":{"a":1,"a":2}}`, "duplicate"},
		{"step not a string", `{"step":1}`, "must be a string"},
	} {
		r := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("bad-" + c.name)}, c.body)
		require.Equal(t, http.StatusBadRequest, r.status, "%s: %s", c.name, r.body)
		require.Contains(t, r.problem(t).Detail, c.detail, c.name)
	}
	r := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("sk-1")}, `{"step":"book"}`)
	require.Equal(t, http.StatusConflict, r.status, "body: %s", r.body)
	require.Contains(t, r.problem(t).Detail, `at step "reserve" (forward), not "book"`)
	require.Zero(t, e.count(t, `select count(*) from idemsaga.repairs`))

	first := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("sk-1")}, body)
	require.Equal(t, http.StatusOK, first.status, "body: %s", first.body)
	var rep httpapi.Repaired
	require.NoError(t, json.Unmarshal(first.body, &rep))
	require.Equal(t, "skip", rep.Operation)
	require.Equal(t, saga.State("reserved"), rep.State)
	again := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("sk-1")}, body)
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, string(first.body), string(again.body))
	other := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("sk-1")}, `{"step":"reserve","result":{"booked":1},"reason":"booked by hand"}`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "body: %s", other.body)

	got := e.do(t, http.MethodGet, "/v1/sagas/"+s.ID.String(), nil, "")
	require.Equal(t, http.StatusOK, got.status)
	var sg httpapi.Saga
	require.NoError(t, json.Unmarshal(got.body, &sg))
	require.Len(t, sg.Repairs, 1)
	require.Equal(t, "skip", sg.Repairs[0].Operation)
	require.Equal(t, "reserve", *sg.Repairs[0].Step)
	require.Equal(t, saga.PhaseForward, *sg.Repairs[0].Phase)
	require.Equal(t, "http", *sg.Repairs[0].By)
	require.Equal(t, saga.State("reserved"), sg.Repairs[0].StateAfter)
	require.JSONEq(t, `{"booked":0}`, string(sg.Results["reserve"]))

	cl := e.do(t, http.MethodPost, "/v1/sagas/"+s.ID.String()+"/close", []hdr{key("c-1")}, "")
	require.Equal(t, http.StatusConflict, cl.status, "body: %s", cl.body)
	require.Contains(t, cl.problem(t).Detail, "only a failed or parked saga can be closed")
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.repairs`))
}

// TestBulkRepairs: POST /v1/repairs lists what it would do in a dry run,
// repairs each saga under the key and its ID, replays when sent again,
// and refuses bad requests whole.
func TestBulkRepairs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, k := range []string{"b-1", "b-2", "b-3"} {
		started(t, e.start(t, k, `{"account":4,"amount":40}`))
	}
	type bulkBody = httpapi.BulkRepaired
	post := func(k, body string) (response, bulkBody) {
		r := e.do(t, http.MethodPost, "/v1/repairs", []hdr{jsonType(), key(k)}, body)
		var out bulkBody
		if r.status == http.StatusOK {
			require.NoError(t, json.Unmarshal(r.body, &out))
		}
		return r, out
	}
	r, dry := post("bulk-1", `{"operation":"cancel","filter":{"state":"init"},"limit":2,"dry_run":true,"reason":"incident 7"}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.True(t, dry.DryRun)
	require.Len(t, dry.Items, 2)
	require.NotNil(t, dry.NextCursor)
	for _, it := range dry.Items {
		require.Nil(t, it.Problem)
		require.Equal(t, saga.StateCompensated, *it.State)
		require.Nil(t, it.At)
		require.Equal(t, "bulk-1/"+it.ID.String(), it.Key)
	}
	r, rest := post("bulk-1", `{"operation":"cancel","filter":{"state":"init"},"limit":2,"dry_run":true,"reason":"incident 7","cursor":"`+*dry.NextCursor+`"}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Len(t, rest.Items, 1)
	require.Nil(t, rest.NextCursor)
	require.Zero(t, e.count(t, `select count(*) from idemsaga.repairs`))
	require.Equal(t, 3, e.count(t, `select count(*) from idemsaga.sagas where state = 'init'`))

	r, done := post("bulk-1", `{"operation":"cancel","filter":{"state":"init"},"reason":"incident 7"}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Len(t, done.Items, 3)
	for _, it := range done.Items {
		require.Nil(t, it.Problem)
		require.False(t, it.Replayed)
		require.NotNil(t, it.At)
	}
	r, replay := post("bulk-1", `{"operation":"cancel","filter":{"definition":"payout"},"reason":"incident 7"}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Len(t, replay.Items, 3)
	for _, it := range replay.Items {
		require.True(t, it.Replayed)
	}
	r, refused := post("bulk-2", `{"operation":"close","filter":{"definition":"payout"}}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	for _, it := range refused.Items {
		require.Equal(t, httpapi.ProblemStateForbids, it.Problem.Type)
		require.Nil(t, it.State)
	}
	require.Equal(t, 3, e.count(t, `select count(*) from idemsaga.repairs`))

	for _, c := range []struct {
		name, body, detail string
	}{
		{"no operation", `{"filter":{"state":"init"}}`, `"operation" is missing`},
		{"unknown operation", `{"operation":"reboot","filter":{"state":"init"}}`, "the repairs are"},
		{"no filter", `{"operation":"close"}`, "needs a definition or a state"},
		{"filter member", `{"operation":"close","filter":{"State":"init"}}`, `in member "filter"`},
		{"bad state", `{"operation":"close","filter":{"state":"parkd"}}`, "no saga can be in state"},
		{"limit", `{"operation":"close","filter":{"state":"init"},"limit":0}`, "limit 0"},
		{"skip without step", `{"operation":"skip","filter":{"state":"init"}}`, "name the step"},
		{"step of a close", `{"operation":"close","filter":{"state":"init"},"step":"x"}`, "belong to a skip"},
		{"dry_run not a bool", `{"operation":"close","filter":{"state":"init"},"dry_run":"yes"}`, "true or false"},
	} {
		r, _ := post("bad-"+c.name, c.body)
		require.Equal(t, http.StatusBadRequest, r.status, "%s: %s", c.name, r.body)
		require.Contains(t, r.problem(t).Detail, c.detail, c.name)
	}
	nokey := e.do(t, http.MethodPost, "/v1/repairs", []hdr{jsonType()}, `{"operation":"close","filter":{"state":"init"}}`)
	require.Equal(t, http.StatusBadRequest, nokey.status)
	require.Equal(t, httpapi.ProblemKeyMissing, nokey.problem(t).Type)
	require.Equal(t, 3, e.count(t, `select count(*) from idemsaga.repairs`))
}
