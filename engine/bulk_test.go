package engine_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// TestBulkRepair: a dry run lists what a bulk repair would do and writes
// nothing, page by page; one saga's refusal does not stop the others; two
// copies of one bulk close sent at once close each saga once; the same
// key with another reason is refused saga by saga.
func TestBulkRepair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	o := &otherSystem{}
	def := payDef(o)
	env := payEnv(t, def)
	for i := range 5 {
		parked(t, env, def, "p-"+itoa(i))
	}
	done := env.Run(t, def, "done", map[string]int{})
	require.Equal(t, saga.State("shipped"), done.State)

	// Dry run over the definition, three at a time.
	var items []engine.BulkItem
	cursor := ""
	for page := 0; ; page++ {
		res, err := env.Client.Bulk(ctx, engine.BulkRepair{Operation: "retry", DryRun: true, Repair: engine.Repair{Key: "dry"},
			Filter: engine.ListOptions{Definition: "pay", Limit: 3, Cursor: cursor}})
		require.NoError(t, err)
		items = append(items, res.Items...)
		if cursor = res.NextCursor; cursor == "" {
			break
		}
		require.Less(t, page, 3)
	}
	require.Len(t, items, 6)
	would := map[string]int{}
	for _, it := range items {
		require.True(t, it.DryRun)
		require.Equal(t, engine.BulkKey("dry", it.ID), it.Key)
		if it.Err != nil {
			require.ErrorIs(t, it.Err, engine.ErrStateForbids)
			require.Equal(t, done.ID, it.ID)
			would["refused"]++
			continue
		}
		require.Equal(t, saga.StateParked, it.Before)
		would[string(it.State)]++
	}
	require.Equal(t, map[string]int{"init": 5, "refused": 1}, would)
	require.Zero(t, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs`), "a dry run writes nothing")
	require.EqualValues(t, 5, countSQL(t, env.Pool, `select count(*) from idemsaga.sagas where state = 'parked'`))
	require.Zero(t, countSQL(t, env.Pool, `select count(*) from idemsaga.outbox`))

	// Two copies of one bulk close at once.
	req := engine.BulkRepair{Operation: "close", Filter: engine.ListOptions{State: saga.StateParked},
		Repair: engine.Repair{Key: "incident-42", Reason: "refunded by hand", By: "ops"}}
	var wg sync.WaitGroup
	results := make([]engine.BulkResult, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Go(func() { results[i], errs[i] = env.Client.Bulk(ctx, req) })
	}
	wg.Wait()
	fresh := 0
	for i := range 2 {
		require.NoError(t, errs[i])
		require.Equal(t, "incident-42", results[i].Key)
		for _, it := range results[i].Items {
			require.NoError(t, it.Err)
			require.Equal(t, saga.StateClosed, it.State)
			if !it.Replayed {
				fresh++
			}
		}
	}
	require.Equal(t, 5, fresh, "each parked saga closed once")
	require.EqualValues(t, 5, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs where operation = 'close' and request_key like 'incident-42/%'`))

	// The same key, another reason: refused saga by saga.
	req.Filter, req.Repair.Reason = engine.ListOptions{Definition: "pay"}, "another reason"
	res, err := env.Client.Bulk(ctx, req)
	require.NoError(t, err)
	require.Len(t, res.Items, 6)
	for _, it := range res.Items {
		if it.ID == done.ID {
			require.ErrorIs(t, it.Err, engine.ErrStateForbids)
			continue
		}
		require.ErrorIs(t, it.Err, engine.ErrRepairKeyReused)
	}
	require.EqualValues(t, 5, countSQL(t, env.Pool, `select count(*) from idemsaga.repairs`))
	noDifferences(t, env.Pool, def)

	for _, bad := range []engine.BulkRepair{
		{Operation: "close"},
		{Operation: "reboot", Filter: engine.ListOptions{State: saga.StateParked}},
		{Operation: "skip", Filter: engine.ListOptions{State: saga.StateParked}},
		{Operation: "close", Filter: engine.ListOptions{State: saga.StateParked, Limit: engine.BulkLimitMax + 1}},
		{Operation: "close", Filter: engine.ListOptions{State: "parkd"}},
	} {
		_, err := env.Client.Bulk(ctx, bad)
		require.Error(t, err)
		require.True(t, errors.Is(err, engine.ErrInvalidFilter) || errors.Is(err, engine.ErrUnknownRepair) || errors.Is(err, engine.ErrStateForbids), "%v", err)
	}
}
