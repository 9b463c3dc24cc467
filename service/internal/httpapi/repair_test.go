package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestCancelReplay cancels a saga twice with one key (one repair, the
// same bytes), refuses the key with another reason, and refuses another
// cancel of the cancelled saga.
func TestCancelReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := started(t, e.start(t, "c-saga", `{"account":4,"amount":40}`))
	path := "/v1/sagas/" + s.ID.String() + "/cancel"
	body := `{"reason":"customer asked"}`

	first := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("cancel-1")}, body)
	require.Equal(t, http.StatusOK, first.status, "body: %s", first.body)
	require.Empty(t, first.header.Get(httpapi.ReplayedHeader))
	var rep httpapi.Repaired
	require.NoError(t, json.Unmarshal(first.body, &rep))
	require.Equal(t, s.ID, rep.ID)
	require.Equal(t, "cancel", rep.Operation)
	require.Equal(t, saga.StateCompensated, rep.State)
	require.Equal(t, "cancel-1", rep.Key)
	require.WithinDuration(t, time.Now(), rep.At, time.Minute)
	require.Equal(t, fmt.Sprintf(`{"id":"%s","operation":"cancel","state":"compensated","key":"cancel-1","at":"%s"}`+"\n",
		s.ID, rep.At.Format(time.RFC3339Nano)), string(first.body))

	again := e.do(t, http.MethodPost, path, []hdr{jsonType(), key(`"cancel-1"`)}, body)
	require.Equal(t, http.StatusOK, again.status, "body: %s", again.body)
	require.Equal(t, "true", again.header.Get(httpapi.ReplayedHeader))
	require.Equal(t, string(first.body), string(again.body))

	other := e.do(t, http.MethodPost, path, []hdr{jsonType(), key("cancel-1")}, `{"reason":"another reason"}`)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "body: %s", other.body)
	require.Equal(t, httpapi.ProblemKeyReused, other.problem(t).Type)

	late := e.do(t, http.MethodPost, path, []hdr{key("cancel-2")}, "")
	require.Equal(t, http.StatusConflict, late.status, "body: %s", late.body)
	p := late.problem(t)
	require.Equal(t, httpapi.ProblemStateForbids, p.Type)
	require.Contains(t, p.Detail, `"compensated"`)
	require.Contains(t, p.Detail, "only a running saga")

	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.repairs`))
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.repairs where request_key = 'cancel-1' and reason = 'customer asked' and requested_by = 'http'`))
	var state, why string
	require.NoError(t, e.pool.QueryRow(context.Background(), `select state, error from idemsaga.sagas where id = $1`, s.ID).Scan(&state, &why))
	require.Equal(t, "compensated", state)
	require.Contains(t, why, "customer asked")
}

// TestRepairRefusals: every refusal of a repair answers a problem and
// changes nothing.
func TestRepairRefusals(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := started(t, e.start(t, "r-saga", `{"account":4,"amount":40}`))
	cancel := "/v1/sagas/" + s.ID.String() + "/cancel"
	cases := []struct {
		name    string
		path    string
		headers []hdr
		body    string
		status  int
		typ     string
		detail  string
	}{
		{"not a UUID", "/v1/sagas/x/cancel", []hdr{key("k")}, "", 400, httpapi.ProblemMalformedRequest, `"x"`},
		{"unknown saga", "/v1/sagas/" + uuid.Nil.String() + "/retry", []hdr{key("k")}, "", 404, httpapi.ProblemNotFound, uuid.Nil.String()},
		{"missing key", cancel, nil, "", 400, httpapi.ProblemKeyMissing, "Idempotency-Key"},
		{"two keys", cancel, []hdr{key("a"), key("b")}, "", 400, httpapi.ProblemKeyInvalid, "exactly one"},
		{"key with spaces", cancel, []hdr{key(`" k "`)}, "", 400, httpapi.ProblemKeyInvalid, "space"},
		{"not JSON", cancel, []hdr{key("k"), {"Content-Type", "text/plain"}}, "stop", 415, httpapi.ProblemUnsupportedMediaType, "text/plain"},
		{"unknown member", cancel, []hdr{key("k"), jsonType()}, `{"reason":"x","by":"me"}`, 400, httpapi.ProblemMalformedRequest, `"by"`},
		{"case twin", cancel, []hdr{key("k"), jsonType()}, `{"REASON":"x"}`, 400, httpapi.ProblemMalformedRequest, `"REASON"`},
		{"duplicate", cancel, []hdr{key("k"), jsonType()}, `{"reason":"a","reason":"b"}`, 400, httpapi.ProblemMalformedRequest, "twice"},
		{"not a string", cancel, []hdr{key("k"), jsonType()}, `{"reason":1}`, 400, httpapi.ProblemMalformedRequest, "string"},
		{"array", cancel, []hdr{key("k"), jsonType()}, `["x"]`, 400, httpapi.ProblemMalformedRequest, "object"},
		{"two values", cancel, []hdr{key("k"), jsonType()}, `{} {}`, 400, httpapi.ProblemMalformedRequest, "more than one"},
		{"truncated", cancel, []hdr{key("k"), jsonType()}, `{"reason":"x"`, 400, httpapi.ProblemMalformedRequest, "JSON"},
		{"retry of a running saga", "/v1/sagas/" + s.ID.String() + "/retry", []hdr{key("k")}, "", 409, httpapi.ProblemStateForbids, "a retry would race it"},
	}
	for _, c := range cases {
		r := e.do(t, http.MethodPost, c.path, c.headers, c.body)
		require.Equal(t, c.status, r.status, "%s: %s", c.name, r.body)
		p := r.problem(t)
		require.Equal(t, c.typ, p.Type, c.name)
		require.Contains(t, p.Detail, c.detail, c.name)
	}
	require.Zero(t, e.count(t, `select count(*) from idemsaga.repairs`))
	require.Equal(t, 1, e.count(t, `select count(*) from idemsaga.sagas where state = 'init' and version = 1`))

	// An empty object is no reason.
	r := e.do(t, http.MethodPost, cancel, []hdr{key("k"), jsonType()}, `{}`)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
}
