package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestGetRefusals: an ID that is not a UUID is 400, an unknown one 404.
func TestGetRefusals(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.do(t, http.MethodGet, "/v1/sagas/not-a-uuid", nil, "")
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, httpapi.ProblemMalformedRequest, r.problem(t).Type)
	id := uuid.New()
	r = e.do(t, http.MethodGet, "/v1/sagas/"+id.String(), nil, "")
	require.Equal(t, http.StatusNotFound, r.status)
	p := r.problem(t)
	require.Equal(t, httpapi.ProblemNotFound, p.Type)
	require.Contains(t, p.Detail, id.String())
}

// TestGetStarted shows a saga that has not run: its first step
// dispatched, nulls where nothing happened yet.
func TestGetStarted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	s := started(t, e.start(t, "g-1", `{"account":2,"amount":9}`))
	r := e.do(t, http.MethodGet, "/v1/sagas/"+s.ID.String(), nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	var raw map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(r.body, &raw))
	for _, name := range []string{"id", "definition", "key", "state", "version", "input", "results", "error", "created_at", "updated_at", "finished_at", "steps", "attempts"} {
		require.Contains(t, raw, name)
	}
	require.JSONEq(t, `{"account":2,"amount":9}`, string(raw["input"]))
	require.Equal(t, "null", string(raw["finished_at"]))
	require.Equal(t, "null", string(raw["error"]))
	var sg httpapi.Saga
	require.NoError(t, json.Unmarshal(r.body, &sg))
	require.Equal(t, s.ID, sg.ID)
	require.Equal(t, "g-1", sg.Key)
	require.Equal(t, saga.StateInit, sg.State)
	require.Len(t, sg.Steps, 1)
	st := sg.Steps[0]
	require.Equal(t, "reserve", st.Step)
	require.Equal(t, saga.PhaseForward, st.Phase)
	require.Equal(t, "database", st.Kind)
	require.Equal(t, saga.StepKey(s.ID, "reserve", saga.PhaseForward), st.Key)
	require.Equal(t, 1, st.Attempt)
	require.NotNil(t, st.LeaseUntil)
	require.Nil(t, st.LastError)
}

// TestList pages through every saga exactly once, newest first, filters
// by state and definition, and counts by state.
func TestList(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var ids []uuid.UUID
	for i := range 7 {
		r := e.start(t, fmt.Sprintf("l-%d", i), fmt.Sprintf(`{"account":1,"amount":%d}`, i+1))
		require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
		ids = append(ids, started(t, r).ID)
	}
	for _, id := range ids[:2] {
		r := e.do(t, http.MethodPost, "/v1/sagas/"+id.String()+"/cancel", []hdr{key("c-" + id.String())}, "")
		require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	}
	rows, err := e.pool.Query(context.Background(), `select id from idemsaga.sagas order by created_at desc, id desc`)
	require.NoError(t, err)
	want, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	require.Len(t, want, 7)

	var got []uuid.UUID
	cursor := ""
	for page := 1; ; page++ {
		q := url.Values{"limit": {"3"}}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		l := e.list(t, q)
		require.Equal(t, map[saga.State]int64{saga.StateInit: 5, saga.StateCompensated: 2}, l.Counts)
		for _, s := range l.Sagas {
			got = append(got, s.ID)
			require.Equal(t, "payout", s.Definition)
		}
		if l.NextCursor == nil {
			require.Equal(t, 3, page)
			require.Len(t, l.Sagas, 1)
			break
		}
		require.Len(t, l.Sagas, 3)
		cursor = *l.NextCursor
	}
	require.Equal(t, want, got, "every saga once, newest first")

	l := e.list(t, url.Values{"state": {"compensated"}})
	require.Len(t, l.Sagas, 2)
	require.ElementsMatch(t, ids[:2], []uuid.UUID{l.Sagas[0].ID, l.Sagas[1].ID})
	require.Nil(t, l.NextCursor)
	for _, s := range l.Sagas {
		require.NotNil(t, s.FinishedAt)
		require.NotNil(t, s.Error)
	}
	l = e.list(t, nil)
	require.Len(t, l.Sagas, 7)

	// By key: the saga started under it, nothing for a key none used.
	l = e.list(t, url.Values{"key": {"l-3"}})
	require.Len(t, l.Sagas, 1)
	require.Equal(t, ids[3], l.Sagas[0].ID)
	require.Empty(t, e.list(t, url.Values{"key": {"l-99"}}).Sagas)
	// Oldest first, page by page: the same sagas in the other order.
	var oldest []uuid.UUID
	cursor = ""
	for {
		q := url.Values{"limit": {"4"}, "order": {"oldest"}}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		l := e.list(t, q)
		for _, s := range l.Sagas {
			oldest = append(oldest, s.ID)
		}
		if l.NextCursor == nil {
			break
		}
		cursor = *l.NextCursor
	}
	require.Equal(t, want, reversed(oldest))

	// A time range: the sagas created in it, and none after the last.
	var third time.Time
	require.NoError(t, e.pool.QueryRow(context.Background(), `select created_at from idemsaga.sagas where id = $1`, want[4]).Scan(&third))
	l = e.list(t, url.Values{"created_from": {third.Format(time.RFC3339Nano)}})
	require.Equal(t, want[:5], idsOf(l), "created at or after the third oldest")
	l = e.list(t, url.Values{"created_before": {third.Format(time.RFC3339Nano)}})
	require.Equal(t, want[5:], idsOf(l))
	require.Empty(t, e.list(t, url.Values{"created_from": {time.Now().Add(time.Hour).UTC().Format(time.RFC3339)}}).Sagas)

	// Paused and dead-lettered: one saga paused, none parked.
	r0 := e.do(t, http.MethodPost, "/v1/sagas/"+ids0(want)+"/pause", []hdr{key("pause-l")}, "")
	require.Equal(t, http.StatusOK, r0.status, "body: %s", r0.body)
	l = e.list(t, url.Values{"paused": {"true"}})
	require.Equal(t, want[:1], idsOf(l))
	require.Empty(t, e.list(t, url.Values{"dead_lettered": {"true"}}).Sagas)
	require.Empty(t, e.list(t, url.Values{"waiting": {"true"}}).Sagas)
	require.Len(t, e.list(t, url.Values{"stuck": {"false"}}).Sagas, 7)

	// A key where an ID goes says where to look for it.
	r := e.do(t, http.MethodGet, "/v1/sagas/l-3", nil, "")
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.problem(t).Detail, "GET /v1/sagas?key=l-3")

	// A page as long as the limit has a cursor; the page after it is
	// empty and has none.
	l = e.list(t, url.Values{"limit": {"7"}})
	require.NotNil(t, l.NextCursor)
	l = e.list(t, url.Values{"limit": {"7"}, "cursor": {*l.NextCursor}})
	require.Empty(t, l.Sagas)
	require.Nil(t, l.NextCursor)
}

// TestListRefusals: a bad cursor, limit or parameter is 400.
func TestListRefusals(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, q := range []string{
		"cursor=garbage", "cursor=2024-01-01T00:00:00Z_nope", "cursor=" + uuid.NewString(),
		"limit=0", "limit=501", "limit=-1", "limit=ten", "limit=", "limit=5&limit=6", "colour=red",
		"definition=other", "state=parkd", "created_from=yesterday", "created_before=2026-13-01T00:00:00Z",
		"created_from=2026-12-03T00:00:00Z&created_before=2026-12-02T00:00:00Z", "stuck=yes", "paused=1", "order=random",
	} {
		r := e.do(t, http.MethodGet, "/v1/sagas?"+q, nil, "")
		require.Equal(t, http.StatusBadRequest, r.status, "%s: %s", q, r.body)
		require.Equal(t, httpapi.ProblemMalformedRequest, r.problem(t).Type, q)
	}
	r := e.do(t, http.MethodGet, "/v1/sagas?limit=500", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.JSONEq(t, `{"sagas":[],"next_cursor":null,"counts":{}}`, string(r.body))
}

func (e *env) list(t testing.TB, q url.Values) httpapi.List {
	t.Helper()
	r := e.do(t, http.MethodGet, "/v1/sagas?"+q.Encode(), nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var l httpapi.List
	require.NoError(t, json.Unmarshal(r.body, &l))
	return l
}

// TestGetShowsChildrenAndGroups: a parent's body lists its children and
// the parallel group of each step; a child's names its parent and the
// step that started it.
func TestGetShowsChildrenAndGroups(t *testing.T) {
	t.Parallel()
	ok := func(context.Context, *saga.StepContext) (json.RawMessage, error) {
		return json.RawMessage(`{"ok":true}`), nil
	}
	child := saga.MustNew("httpfx", saga.Step{Name: "quote", Reaches: "quoted", Kind: saga.DatabaseStep, Forward: ok})
	parent := saga.MustNew("httpxfer",
		saga.Step{Name: "fx", Reaches: "converted", Kind: saga.ChildStep, Child: child},
		saga.Step{Name: "a", Group: "notify", Reaches: "notified", Kind: saga.DatabaseStep, Forward: ok},
		saga.Step{Name: "b", Group: "notify", Reaches: "notified", Kind: saga.DatabaseStep, Forward: ok},
	)
	e := engineEnvWith(t, parent)
	r := e.do(t, http.MethodPost, "/v1/sagas/httpxfer", startHeaders("x-1"), `{}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	id := started(t, r).ID
	var sg httpapi.Saga
	require.Eventually(t, func() bool {
		r := e.do(t, http.MethodGet, "/v1/sagas/"+id.String(), nil, "")
		return json.Unmarshal(r.body, &sg) == nil && sg.State == "notified"
	}, 30*time.Second, 20*time.Millisecond)
	require.Nil(t, sg.Parent)
	require.Nil(t, sg.ParentStep)
	require.Len(t, sg.Children, 1)
	require.Equal(t, "fx", sg.Children[0].Step)
	require.Equal(t, "httpfx", sg.Children[0].Definition)
	require.Equal(t, saga.State("quoted"), sg.Children[0].State)
	groups := map[string]string{}
	for _, st := range sg.Steps {
		if st.Group != nil {
			groups[st.Step] = *st.Group
		}
	}
	require.Equal(t, map[string]string{"a": "notify", "b": "notify"}, groups)
	require.Len(t, sg.Plan, 2, "the child step, then the group's branches side by side")
	require.Equal(t, "httpfx@1", sg.Plan[0].Steps[0].Child)
	require.Equal(t, "notify", sg.Plan[1].Group)
	require.Equal(t, []string{"a", "b"}, []string{sg.Plan[1].Steps[0].Name, sg.Plan[1].Steps[1].Name})
	for _, stage := range sg.Plan {
		for _, st := range stage.Steps {
			require.Equal(t, saga.StepSucceeded, st.Status, st.Name)
		}
	}

	r = e.do(t, http.MethodGet, "/v1/sagas/"+sg.Children[0].ID.String(), nil, "")
	var ch httpapi.Saga
	require.NoError(t, json.Unmarshal(r.body, &ch))
	require.NotNil(t, ch.Parent)
	require.Equal(t, id, *ch.Parent)
	require.Equal(t, "fx", *ch.ParentStep)
	require.Empty(t, ch.Children)
}

func idsOf(l httpapi.List) []uuid.UUID {
	out := []uuid.UUID{}
	for _, s := range l.Sagas {
		out = append(out, s.ID)
	}
	return out
}

func ids0(ids []uuid.UUID) string { return ids[0].String() }

func reversed(in []uuid.UUID) []uuid.UUID {
	out := make([]uuid.UUID, len(in))
	for i, v := range in {
		out[len(in)-1-i] = v
	}
	return out
}
