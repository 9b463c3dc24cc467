package service

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// runInBackground runs a long-lived command until the returned function is
// called, which ends it (as SIGTERM would) and returns its log; it returns
// once the log says ready, having handed the log so far to started (nil:
// nothing).
func runInBackground(t *testing.T, cfg Config, ready string, started func(log string), args ...string) (stop func() string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var log testenv.LogBuffer
	done := make(chan error, 1)
	go func() {
		var out bytes.Buffer
		done <- run(ctx, cfg, args, &out, &log)
	}()
	deadline := time.After(30 * time.Second)
	for !strings.Contains(log.String(), ready) {
		select {
		case err := <-done:
			t.Fatalf("%s ended: %v\n%s", args[0], err, log.String())
		case <-deadline:
			t.Fatalf("%s did not log %q within 30s:\n%s", args[0], ready, log.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	if started != nil {
		started(log.String())
	}
	stopped := false
	stop = func() string {
		if !stopped {
			stopped = true
			cancel()
			require.NoError(t, <-done, log.String())
		}
		return log.String()
	}
	t.Cleanup(func() { stop() })
	return stop
}

// TestStepsOnlyProcess: `steps` runs a deployment's step attempts with no
// engine of its own. A saga's first step runs there while no engine runs,
// and its saga waits for one; an engine started later applies the step's
// reply and finishes the saga.
func TestStepsOnlyProcess(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	srv, nc := testenv.NATS(t)
	t.Setenv("NATS_URL", srv.ClientURL())
	t.Setenv("IDEMSAGA_STREAM", testenv.Name("STEPSONLY"))
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)

	// The steps process runs the same definition, counting its hellos.
	var hellos atomic.Int64
	def := saga.MustNew("greet",
		saga.Step{Name: "hello", Reaches: "helloed", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				hellos.Add(1)
				return json.RawMessage(`{"by":"steps"}`), nil
			},
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
		saga.Step{Name: "bye", Reaches: "byed", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
	)
	stopSteps := runInBackground(t, Config{Name: "shopsteps", Definitions: []*saga.Definition{def}}, "step worker running", nil, "steps")

	// No engine runs: a relay of the test's own publishes the start's
	// command and the step's reply.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, JetStream: js, PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, relay.Start(context.Background()))
	t.Cleanup(func() { _ = relay.Stop(context.Background()) })

	out, _, err := runIn(t, Config{Name: "shopadmin"}, "start", "greet", "--key", "s-1", "--input", `{}`)
	require.NoError(t, err)
	id := out[:36]
	require.Eventually(t, func() bool { return replyPublished(t, pool, id) }, 30*time.Second, 10*time.Millisecond,
		"the steps process runs hello and answers with a reply")
	require.EqualValues(t, 1, hellos.Load())
	var state string
	require.NoError(t, pool.QueryRow(context.Background(), `select state::text from idemsaga.sagas where id = $1`, id).Scan(&state))
	require.Equal(t, "init", state, "no engine applied the reply yet")

	// An engine applies the reply, runs bye and finishes the saga.
	require.NoError(t, relay.Stop(context.Background()))
	stopRun := runInBackground(t, shop, "worker running", nil, "run", "--http-addr", "")
	out, _, err = runIn(t, Config{Name: "shopadmin"}, "start", "greet", "--key", "s-1", "--input", `{}`, "--wait", "--timeout", "30s")
	require.NoError(t, err)
	require.Contains(t, out, "byed")
	require.EqualValues(t, 1, hellos.Load(), "hello ran once")
	require.Contains(t, stopRun(), "stopped cleanly")
	require.Contains(t, stopSteps(), "stopped cleanly")
}

// replyPublished reports whether the reply of saga id's first step was
// written and published.
func replyPublished(t *testing.T, pool *pgxpool.Pool, id string) bool {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.inbox i
where i.saga_id = $1 and i.step = 'hello' and i.outcome = 'succeeded'
  and not exists (select 1 from idemsaga.outbox o where o.saga_id = i.saga_id and o.published_at is null)`, id).Scan(&n))
	return n == 1
}
