package httpapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestFlow runs a saga started over HTTP on a real engine: GET shows its
// steps and attempts, a replay still answers the creation's bytes, and a
// cancel of the finished saga is refused with the reason.
func TestFlow(t *testing.T) {
	t.Parallel()
	e := newEngineEnv(t)
	ctx := context.Background()
	first := e.start(t, "flow-1", `{"account":9,"amount":25}`)
	require.Equal(t, http.StatusCreated, first.status, "body: %s", first.body)
	s := started(t, first)

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := e.client.Wait(wctx, s.ID)
	require.NoError(t, err)

	r := e.do(t, http.MethodGet, "/v1/sagas/"+s.ID.String(), nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var sg httpapi.Saga
	require.NoError(t, json.Unmarshal(r.body, &sg))
	require.Equal(t, saga.State("booked"), sg.State)
	require.NotNil(t, sg.FinishedAt)
	require.Nil(t, sg.Error)
	require.Len(t, sg.Steps, 2)
	for i, name := range []string{"reserve", "book"} {
		st := sg.Steps[i]
		require.Equal(t, name, st.Step)
		require.Equal(t, i, st.Index)
		require.Equal(t, saga.PhaseForward, st.Phase)
		require.Equal(t, saga.StepSucceeded, st.Status)
		require.Equal(t, "database", st.Kind)
		require.Equal(t, saga.StepKey(s.ID, name, saga.PhaseForward), st.Key)
		require.JSONEq(t, `{"booked":25}`, string(st.Result))
		require.JSONEq(t, `{"booked":25}`, string(sg.Results[name]))
	}
	require.Len(t, sg.Attempts, 2)
	for i, name := range []string{"reserve", "book"} {
		a := sg.Attempts[i]
		require.Equal(t, name, a.Step)
		require.Equal(t, 1, a.Attempt)
		require.NotNil(t, a.Outcome)
		require.Equal(t, "succeeded", *a.Outcome)
		require.NotNil(t, a.FinishedAt)
	}
	require.Equal(t, 2, e.count(t, `select count(*) from httpapi_test.ledger where saga_id = $1 and phase = 'forward' and account = 9 and amount = 25`, s.ID))

	// The answer is as of creation, whatever the saga did since.
	again := e.start(t, "flow-1", `{"account":9,"amount":25}`)
	require.Equal(t, http.StatusOK, again.status)
	require.Equal(t, string(first.body), string(again.body))

	c := e.do(t, http.MethodPost, "/v1/sagas/"+s.ID.String()+"/cancel", []hdr{key("too-late"), jsonType()}, `{"reason":"changed my mind"}`)
	require.Equal(t, http.StatusConflict, c.status, "body: %s", c.body)
	p := c.problem(t)
	require.Equal(t, httpapi.ProblemStateForbids, p.Type)
	require.Contains(t, p.Detail, `"booked"`)
	require.Equal(t, 2, e.count(t, `select count(*) from httpapi_test.ledger`))
	require.Zero(t, e.count(t, `select count(*) from idemsaga.repairs`))
}
