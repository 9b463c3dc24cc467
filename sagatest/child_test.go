package sagatest_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// TestChildWaitsOnTheKitsClock: a child saga's retry waits out a backoff
// of minutes while its parent waits for it; Run moves the clock to the
// child's retries, not to the parent's deadline, so the child completes
// and the parent takes its result in milliseconds of wall time.
func TestChildWaitsOnTheKitsClock(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	convert := func(context.Context, *saga.StepContext) (json.RawMessage, error) {
		if calls.Add(1) < 3 {
			return nil, errors.New("the rates desk is busy")
		}
		return json.RawMessage(`{"rate":1.1}`), nil
	}
	ok := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	fx := saga.MustNew("kitfx", saga.Step{Name: "convert", Reaches: "converted", Kind: saga.ExternalStep, Forward: convert, Compensate: ok,
		Retry: saga.RetryPolicy{MaxAttempts: 5, InitialBackoff: 10 * time.Minute, MaxBackoff: time.Hour, Timeout: 5 * time.Second}})
	xfer := saga.MustNew("kitxfer",
		saga.Step{Name: "fx", Reaches: "converted", Kind: saga.ChildStep, Child: fx, Wait: 3 * time.Hour},
		saga.Step{Name: "credit", Reaches: "credited", Kind: saga.DatabaseStep, Forward: ok})
	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{xfer}})

	sg := env.Run(t, xfer, "x-1", map[string]int{"amount": 10})
	require.Equal(t, saga.State("credited"), sg.State)
	require.EqualValues(t, 3, calls.Load(), "the child's convert ran three times")
	var results map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(sg.Results["fx"], &results))
	require.JSONEq(t, `{"rate":1.1}`, string(results["convert"]))
	offset, err := env.Clock.Offset(context.Background())
	require.NoError(t, err)
	require.GreaterOrEqual(t, offset, 24*time.Minute, "the clock passed the child's backoffs (10 and 20 minutes, less their jitter of up to a fifth)")
	require.Less(t, offset, 3*time.Hour, "and not the parent's wait")
}
