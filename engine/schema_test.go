package engine_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

// TestTwoDeploymentsSideBySide: two deployments share one database, in
// two schemas, and one NATS server, each with its own stream and subject
// prefix. They run a definition of the same name and start sagas under
// the same keys at once, and never see each other's sagas: each runs
// its own, reads its own, reconciles clean, and the default schema stays
// empty. A deployment that names the other's stream is refused at start.
func TestTwoDeploymentsSideBySide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	for _, schema := range []string{"tenant_a", "tenant_b"} {
		require.NoError(t, migrations.MigrateSchema(ctx, conn.Conn(), schema))
	}
	conn.Release()

	type deployment struct {
		schema, stream string
		mu             sync.Mutex
		ran            map[uuid.UUID]int
		def            *saga.Definition
		e              *engine.Engine
	}
	deps := []*deployment{{schema: "tenant_a", stream: testenv.Name("SIDEA")}, {schema: "tenant_b", stream: testenv.Name("SIDEB")}}
	for _, d := range deps {
		d.ran = map[uuid.UUID]int{}
		step := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			d.mu.Lock()
			defer d.mu.Unlock()
			d.ran[sc.SagaID]++
			return json.RawMessage(fmt.Sprintf(`{"by":%q}`, d.schema)), nil
		}
		d.def = saga.MustNew("payout", dbStep("reserve", "reserved", step, fastPolicy), dbStep("book", "booked", step, fastPolicy))
		d.e = startEngine(t, pool, nc, d.stream, []*saga.Definition{d.def}, func(c *engine.Config) { c.Schema = d.schema })
	}

	const n = 20
	ids := make([][]uuid.UUID, len(deps))
	var wg sync.WaitGroup
	for i, d := range deps {
		ids[i] = make([]uuid.UUID, n)
		for k := range n {
			wg.Go(func() {
				res, err := d.e.Client().Start(ctx, d.def, fmt.Sprintf("order-%d", k), map[string]int{"n": k})
				require.NoError(t, err)
				ids[i][k] = res.ID
			})
		}
	}
	wg.Wait()
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for i, d := range deps {
		other := deps[1-i]
		for k, id := range ids[i] {
			sg, err := d.e.Client().Wait(wctx, id)
			require.NoError(t, err)
			require.Equal(t, saga.State("booked"), sg.State)
			require.JSONEq(t, fmt.Sprintf(`{"by":%q}`, d.schema), string(sg.Results["book"]), "run by its own deployment's workers")
			_, err = other.e.Client().Get(ctx, id)
			require.ErrorIs(t, err, saga.ErrNotFound, "the other deployment does not see it")
			mine, err := d.e.Client().Lookup(ctx, fmt.Sprintf("order-%d", k))
			require.NoError(t, err)
			require.Equal(t, id, mine.ID, "a key names this deployment's saga")
		}
		d.mu.Lock()
		require.Len(t, d.ran, n, "each deployment's handlers ran its own sagas only")
		for _, id := range ids[i] {
			require.Equal(t, 2, d.ran[id], "two steps, once each")
		}
		d.mu.Unlock()
		require.Equal(t, n, countRows(t, ctx, pool, fmt.Sprintf(`select count(*) from %s.sagas where state = 'booked'`, d.schema)))
		diffs, err := engine.ReconcileSchema(ctx, pool, d.schema, []*saga.Definition{d.def}, 0)
		require.NoError(t, err)
		require.Empty(t, diffs)
	}
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas`), "the default schema holds nothing")

	// A third deployment, tenant_c, whose settings name tenant_a's
	// stream, is refused at start: the stream is tenant_a's.
	conn, err = pool.Acquire(ctx)
	require.NoError(t, err)
	require.NoError(t, migrations.MigrateSchema(ctx, conn.Conn(), "tenant_c"))
	conn.Release()
	cfg := engine.Config{Pool: pool, NATS: nc, Schema: "tenant_c", Definitions: []*saga.Definition{deps[1].def}, Stream: deps[0].stream,
		SubjectPrefix: "t." + deps[0].stream, Logger: quietLogger()}
	require.NoError(t, engine.Deploy(ctx, cfg))
	e, err := engine.New(cfg)
	require.NoError(t, err)
	err = e.Start(ctx)
	require.ErrorContains(t, err, `serves the deployment of PostgreSQL schema "tenant_a", and this one's is "tenant_c"`)
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from tenant_c.sagas`))

	// A schema name the engine cannot use is refused before anything.
	_, err = engine.New(engine.Config{Pool: pool, NATS: nc, Schema: "Tenant-A", Definitions: []*saga.Definition{deps[0].def}})
	require.ErrorContains(t, err, `Config.Schema`)
}
