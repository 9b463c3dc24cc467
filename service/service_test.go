package service

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func greetDefinition() *saga.Definition {
	return saga.MustNew("greet",
		saga.Step{Name: "hello", Reaches: "helloed", Kind: saga.DatabaseStep,
			Forward:    func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
		saga.Step{Name: "bye", Reaches: "byed", Kind: saga.DatabaseStep,
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
	)
}

func runIn(t *testing.T, cfg Config, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), cfg, args, &out, &errOut)
	return out.String(), errOut.String(), err
}

// TestAdminWithoutWorkersSaysWhoWillRunTheSteps: an admin binary (no
// definitions) starts and cancels a saga from the deployment's record;
// with no worker running the definition, it says the steps wait for one.
func TestAdminWithoutWorkersSaysWhoWillRunTheSteps(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}

	_, _, err := runIn(t, admin, "start", "greet", "--key", "g-1", "--input", `{}`)
	require.ErrorIs(t, err, saga.ErrUnknownDefinition, "nothing recorded it yet")
	require.ErrorContains(t, err, "the deployment has none yet: run `migrate`")

	out, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	require.Contains(t, out, "definitions greet")

	out, _, err = runIn(t, admin, "start", "greet", "--key", "g-1", "--input", `{"name":"ann"}`)
	require.NoError(t, err)
	id := out[:36]
	out, errOut, err := runIn(t, admin, "cancel", "g-1", "--reason", "test", "--request-key", "r-1")
	require.NoError(t, err)
	require.Contains(t, out, "saga "+id+": cancelled")
	_ = errOut
	out, _, err = runIn(t, admin, "cancel", "g-1", "--reason", "test", "--request-key", "r-1")
	require.NoError(t, err)
	require.Contains(t, out, "already cancelled by this request (key r-1)")
	_, _, err = runIn(t, admin, "cancel", "g-1", "--reason", "other", "--request-key", "r-1")
	require.ErrorContains(t, err, "already used for another request")

	out, _, err = runIn(t, admin, "workers")
	require.NoError(t, err)
	require.Contains(t, out, "0 live workers")
	_, _, err = runIn(t, shop, "run", "--http-addr", "", "--nats-url", "nats://127.0.0.1:1")
	require.ErrorContains(t, err, "cannot reach NATS")

	_, _, err = runIn(t, admin, "run")
	require.ErrorContains(t, err, "has no saga definitions to run")
}

// TestSettingsMismatchIsRefused: a process whose shared settings differ
// from what migrate recorded says which and how to fix it.
func TestSettingsMismatchIsRefused(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	_, _, err := runIn(t, shop, "migrate", "--lease-grace", "10s")
	require.NoError(t, err)
	_, _, err = runIn(t, shop, "start", "greet", "--key", "g-1", "--input", `{}`)
	require.ErrorContains(t, err, `lease_grace is "30s" here but "10s" in the deployment`)
	require.ErrorContains(t, err, "--lease-grace")
	_, _, err = runIn(t, shop, "start", "greet", "--key", "g-1", "--input", `{}`, "--lease-grace", "10s")
	require.NoError(t, err)
}

func TestRedactURLs(t *testing.T) {
	for in, want := range map[string]string{
		"nats://127.0.0.1:4222":                           "nats://127.0.0.1:4222",
		"nats://u:p4ssw0rd@h:4222":                        "nats://u:xxxxx@h:4222",
		"nats://t0ken-abc@h:4222,nats://u:pw-two@h2:4222": "nats://xxxxx@h:4222,nats://u:xxxxx@h2:4222",
		"alice:S3cretPassw0rd@127.0.0.1:14999":            "nats://alice:xxxxx@127.0.0.1:14999",
	} {
		shown, secrets := redactURLs(in)
		require.Equal(t, want, shown)
		for _, s := range secrets {
			require.NotContains(t, shown, s+"@")
		}
	}
	require.Equal(t, "dial xxxxx failed", redact("dial p4ssw0rd failed", "p4ssw0rd"))
}

// TestCancelWithNoWorkerLeft: a saga whose first step a worker ran and
// whose second waits for a retry is cancelled by an admin binary after
// every worker stopped: the cancel commits, and the admin says its
// compensation waits for a worker running the definition.
func TestCancelWithNoWorkerLeft(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	srv, _ := testenv.NATS(t)
	t.Setenv("DATABASE_URL", url)
	t.Setenv("NATS_URL", srv.ClientURL())
	t.Setenv("IDEMSAGA_STREAM", testenv.Name("NOWORKER"))
	def := saga.MustNew("wait",
		saga.Step{Name: "first", Reaches: "firsted", Kind: saga.DatabaseStep,
			Forward:    func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
			Compensate: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }},
		saga.Step{Name: "second", Reaches: "seconded", Kind: saga.DatabaseStep,
			Retry: saga.RetryPolicy{MaxBackoff: 2 * time.Hour},
			Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) {
				return nil, saga.RetryAfter(errors.New("not before an hour"), time.Hour)
			}},
	)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{def}}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		var out, errOut bytes.Buffer
		done <- run(ctx, shop, []string{"run", "--http-addr", ""}, &out, &errOut)
	}()
	out, _, err := runIn(t, shop, "start", "wait", "--key", "w-1", "--input", `{}`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var n int
		_ = pool.QueryRow(context.Background(), `select count(*) from idemsaga.steps where step = 'second' and status = 'retrying'`).Scan(&n)
		return n == 1
	}, 30*time.Second, 10*time.Millisecond)
	stop()
	require.NoError(t, <-done)

	admin := Config{Name: "shopadmin"}
	out, errOut, err := runIn(t, admin, "cancel", strings.TrimSpace(out))
	require.NoError(t, err)
	require.Contains(t, out, "now compensating")
	require.Contains(t, errOut, `no live worker runs definition "wait"`)
	var pending int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from idemsaga.outbox where published_at is null`).Scan(&pending))
	require.Equal(t, 1, pending, "the compensation's command waits in the outbox")
}

// TestPolicyMismatchNamesTheFields: a worker whose step policy differs
// from the recorded one is told which fields differ.
func TestPolicyMismatchNamesTheFields(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	_, _, err := runIn(t, Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}, "migrate")
	require.NoError(t, err)
	changed := greetDefinition().Steps()
	changed[1].Retry = saga.RetryPolicy{MaxAttempts: 4, InitialBackoff: 200 * time.Millisecond}
	def := saga.MustNew("greet", changed...)
	_, _, err = runIn(t, Config{Name: "shop", Definitions: []*saga.Definition{def}}, "start", "greet", "--key", "k", "--input", "{}")
	require.ErrorContains(t, err, `step "bye" retry.max_attempts 4 here, 5 in the deployment; step "bye" retry.initial_backoff 200ms here, 100ms in the deployment`)
	_, _, err = runIn(t, Config{Name: "shop"}, "start", "nosuch", "--key", "k", "--input", "{}")
	require.ErrorContains(t, err, `no saga definition is named "nosuch"; the deployment has greet`)
}
