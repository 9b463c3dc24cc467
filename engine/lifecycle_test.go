package engine_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// gated is one external step whose handler, while hold is set, waits
// for release or for its context's end, and says which (ended).
type gated struct {
	hold    atomic.Bool
	entered chan struct{}
	release chan struct{}
	ended   chan error
}

func newGated() *gated {
	return &gated{entered: make(chan struct{}, 8), release: make(chan struct{}), ended: make(chan error, 8)}
}

func (g *gated) definition() *saga.Definition {
	return saga.MustNew("gated", saga.Step{Name: "call", Reaches: "called", Kind: saga.ExternalStep,
		Retry: saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond, Timeout: time.Minute},
		Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			if !g.hold.Load() {
				return nil, nil
			}
			g.entered <- struct{}{}
			select {
			case <-g.release:
				g.ended <- nil
				return nil, nil
			case <-ctx.Done():
				g.ended <- ctx.Err()
				return nil, ctx.Err()
			}
		}})
}

func newLifecycleEngine(t *testing.T, def *saga.Definition) (*engine.Engine, *engine.Client, *pgxpool.Pool) {
	t.Helper()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("LIFE")
	cfg := engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: stream, SubjectPrefix: "t." + stream,
		ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond, RelayHandOff: time.Second, Logger: quietLogger()}
	require.NoError(t, engine.Deploy(context.Background(), cfg))
	e, err := engine.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.StopAndCancel(context.Background()) })
	return e, e.Client(), pool
}

func requireClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: not after 30s", what)
	}
}

func requireOpen(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
		t.Fatalf("%s: closed", what)
	default:
	}
}

// TestEngineStartsAgain: an engine stopped can be started again, and runs
// sagas again; Start on a running engine is refused; Stopped is closed
// while it is stopped and open while it runs; Stop twice is fine.
func TestEngineStartsAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGated()
	def := g.definition()
	e, cl, _ := newLifecycleEngine(t, def)
	requireClosed(t, e.Stopped(), "an engine never started is stopped")
	for i, key := range []string{"first-run", "second-run"} {
		require.NoError(t, e.Start(ctx), "run %d", i+1)
		requireOpen(t, e.Stopped(), "a running engine")
		require.ErrorContains(t, e.Start(ctx), "already started")
		res, err := cl.Start(ctx, def, key, map[string]int{})
		require.NoError(t, err)
		waitState(t, cl, res.ID, "called")
		require.NoError(t, e.Stop(ctx))
		require.NoError(t, e.Stop(ctx), "a second Stop")
		requireClosed(t, e.Stopped(), "a stopped engine")
	}
}

// TestStartContextStopsTheEngine: the end of the context Start was given
// stops the engine and cancels the work in hand, as StopAndCancel does.
func TestStartContextStopsTheEngine(t *testing.T) {
	t.Parallel()
	g := newGated()
	g.hold.Store(true)
	def := g.definition()
	e, cl, _ := newLifecycleEngine(t, def)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, e.Start(ctx))
	_, err := cl.Start(context.Background(), def, "ctx-1", map[string]int{})
	require.NoError(t, err)
	<-g.entered
	cancel()
	require.ErrorIs(t, <-g.ended, context.Canceled, "the handler's context ended with Start's")
	requireClosed(t, e.Stopped(), "the engine stopped")
}

// TestStopWaitsAndStopAndCancelCancels: a graceful Stop whose context ends
// while a handler runs returns that error, and the engine goes on
// draining (Stopped stays open); StopAndCancel then cancels the handler,
// whose attempt is recorded as unknown; started again, the engine runs the
// step's next attempt under the same key, and the saga ends.
func TestStopWaitsAndStopAndCancelCancels(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGated()
	g.hold.Store(true)
	def := g.definition()
	e, cl, pool := newLifecycleEngine(t, def)
	require.NoError(t, e.Start(ctx))
	res, err := cl.Start(ctx, def, "cancel-1", map[string]int{})
	require.NoError(t, err)
	<-g.entered

	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	err = e.Stop(short)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "goes on draining")
	requireOpen(t, e.Stopped(), "a drain still in progress")
	require.ErrorContains(t, e.Start(ctx), "still stopping")

	require.NoError(t, e.StopAndCancel(ctx))
	require.ErrorIs(t, <-g.ended, context.Canceled)
	requireClosed(t, e.Stopped(), "the engine stopped")
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.False(t, sg.Finished())
	require.True(t, sg.Steps[0].PossiblyDone, "the call cut short may have taken effect")

	g.hold.Store(false)
	require.NoError(t, e.Start(ctx))
	done := waitState(t, cl, res.ID, "called")
	require.Equal(t, 2, done.Steps[0].Attempt, "the next attempt, under the same key")
	var key string
	require.NoError(t, pool.QueryRow(ctx, `select step_key::text from idemsaga.inbox where saga_id = $1`, pguuid.Of(res.ID)).Scan(&key))
	require.Equal(t, done.Steps[0].Key.String(), key)
	require.NoError(t, e.Stop(ctx))
}
