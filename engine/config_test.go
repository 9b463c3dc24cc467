package engine_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	defs := []*saga.Definition{fixture.Default}
	cases := []struct {
		cfg  engine.Config
		want string
	}{
		{engine.Config{NATS: nc, Definitions: defs}, "Config.Pool is required"},
		{engine.Config{Pool: pool, Definitions: defs}, "Config.NATS is required"},
		{engine.Config{Pool: pool, NATS: nc}, "Config.Definitions is empty"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, Stream: "a.b"}, "Config.Stream"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, SubjectPrefix: "a.>"}, "Config.SubjectPrefix"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, AckWait: time.Second}, "Config.AckWait"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: append(defs, fixture.Default)}, "names transfer@1 twice"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, LeaseGrace: -time.Second}, "must not be negative"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, StreamReplicas: 7}, "Config.StreamReplicas 7 must be 1 to 5"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, StreamStorage: "disk"}, "Config.StreamStorage"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, StreamMaxAge: time.Minute, StreamDuplicateWindow: time.Hour}, "must not exceed StreamMaxAge"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, ShedOldestAge: -time.Second}, "Config.ShedOldestAge is -1s; use a positive duration, 0 for the lease grace, or NoShedding"},
		{engine.Config{Pool: pool, NATS: nc, Definitions: defs, Retention: engine.RetentionConfig{FinishedSagas: -time.Hour}}, "RetentionConfig.FinishedSagas is -1h0m0s"},
	}
	for _, tc := range cases {
		_, err := engine.New(tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
}

func TestEngineRefusesUnmigratedDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	_, err := pool.Exec(ctx, `drop schema idemsaga cascade`)
	require.NoError(t, err)
	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{fixture.Default}, Logger: quietLogger()})
	require.NoError(t, err)
	require.ErrorContains(t, e.Start(ctx), "apply the migrations first")
	require.NoError(t, e.Stop(ctx), "stopping an engine that never started is fine")
}

func TestStartRejectsOversizedInput(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	notes := saga.MustNew("notes", saga.Step{Name: "keep", Reaches: "kept", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{notes}, MaxInputBytes: 100})
	require.NoError(t, err)
	_, err = cl.Start(context.Background(), notes, "big", map[string]string{"note": strings.Repeat("x", 200)})
	require.ErrorContains(t, err, "over the 100-byte limit")
	require.ErrorIs(t, err, saga.ErrInvalidInput)
}

// TestStartTxUnderRepeatableRead: concurrent starts of one key inside
// REPEATABLE READ transactions still make one saga; the loser gets a
// conflict it can retry, not a driver error.
func TestStartTxUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{fixture.Default}})
	require.NoError(t, err)
	tx1, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx1.Rollback(ctx) //nolint:errcheck
	tx2, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx2.Rollback(ctx)                                        //nolint:errcheck
	_, err = tx2.Exec(ctx, `select 1 from idemsaga.sagas limit 1`) // take the snapshot now
	require.NoError(t, err)

	_, err = cl.StartTx(ctx, tx1, fixture.Default, "rr", transferInput(1, 2, 3))
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := cl.StartTx(ctx, tx2, fixture.Default, "rr", transferInput(1, 2, 3))
		done <- err
	}()
	testenv.WaitForLockWaiters(t, pool, 1) // tx2 waits on tx1's key
	require.NoError(t, tx1.Commit(ctx))
	err = <-done
	require.ErrorIs(t, err, saga.ErrConflict)
	require.ErrorContains(t, err, "READ COMMITTED")
}

// TestConfigWithDefaults: WithDefaults fills the zero fields with the
// defaults the engine runs with, on a copy; special values stay.
func TestConfigWithDefaults(t *testing.T) {
	t.Parallel()
	def := saga.MustNew("slow", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep,
		Retry:   saga.RetryPolicy{Timeout: 2 * time.Minute},
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	cfg := engine.Config{Definitions: []*saga.Definition{def}, LeaseGrace: time.Minute, ShedStreamMessages: 5,
		Retention: engine.RetentionConfig{FinishedSagas: engine.KeepForever}}
	d := cfg.WithDefaults()
	require.Zero(t, cfg.StepConcurrency, "the original is left alone")
	require.Equal(t, engine.StreamDefault, d.Stream)
	require.Equal(t, engine.SubjectPrefixDefault, d.SubjectPrefix)
	require.Equal(t, engine.StepConcurrencyDefault, d.StepConcurrency)
	require.Equal(t, engine.ReplyConcurrencyDefault, d.ReplyConcurrency)
	require.Equal(t, time.Minute, d.LeaseGrace, "a value given stays")
	require.Equal(t, time.Minute, d.ShedOldestAge, "shedding by age defaults to the lease grace")
	require.Equal(t, 5, d.ShedStreamMessages)
	require.Equal(t, 2*time.Minute+30*time.Second, d.AckWait, "past the longest step timeout")
	require.Equal(t, engine.KeepForever, d.Retention.FinishedSagas, "a special value stays")
	require.Equal(t, engine.RetentionBatchSizeDefault, d.Retention.BatchSize)
	require.NotNil(t, d.Logger)
	again := d.WithDefaults()
	require.Equal(t, d, again, "defaults applied twice are the same")
	noShed := engine.Config{ShedOldestAge: engine.NoShedding}
	require.Equal(t, engine.NoShedding, noShed.WithDefaults().ShedOldestAge)
}
