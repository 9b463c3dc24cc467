package engine_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestManyProcessesRecordOneDeployment: twenty clients checking a fresh
// deployment at once all succeed (one records, the others read), and a
// client that disagrees records nothing.
func TestManyProcessesRecordOneDeployment(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	var wg sync.WaitGroup
	errs := make([]error, 20)
	gate := make(chan struct{})
	for i := range errs {
		wg.Go(func() {
			cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, LeaseGrace: 10 * time.Second})
			if err != nil {
				errs[i] = err
				return
			}
			<-gate
			errs[i] = cl.Check(ctx)
		})
	}
	close(gate)
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}

	other := saga.MustNew("other", saga.Step{Name: "s", Reaches: "done", Kind: saga.DatabaseStep, Forward: def.Step(0).Forward})
	wrong, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{other}, LeaseGrace: time.Second})
	require.NoError(t, err)
	require.ErrorIs(t, wrong.Check(ctx), engine.ErrDeploymentMismatch)
	var n int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.definitions where name = 'other'`).Scan(&n))
	require.Zero(t, n, "a process that refuses records nothing")
}

// TestDefinitionVersionsAreRecordsOfTheirOwn: a new version of a
// definition is recorded beside the old one, not refused as a mismatch;
// the same version with another description still is; a process may run
// several versions of one name, each once.
func TestDefinitionVersionsAreRecordsOfTheirOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	def := transferDef(t)
	v2 := saga.WithVersion(saga.MustNew(def.Name(), def.Steps()[0]), 2)
	check := func(defs ...*saga.Definition) error {
		cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: defs, LeaseGrace: 10 * time.Second})
		if err != nil {
			return err
		}
		return cl.Check(ctx)
	}
	require.NoError(t, check(def))
	require.NoError(t, check(v2), "a new version is a new record")
	require.NoError(t, check(def, v2))
	other := saga.WithVersion(saga.MustNew(def.Name(), def.Steps()[1]), 2)
	err := check(other)
	require.ErrorIs(t, err, engine.ErrDeploymentMismatch)
	require.ErrorContains(t, err, "definition transfer@2 differs")
	require.ErrorContains(t, err, "give the changed definition a new version")
	_, err = engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{v2, v2}})
	require.ErrorContains(t, err, "names transfer@2 twice")

	cl, err := engine.NewClient(engine.Config{Pool: pool, LeaseGrace: 10 * time.Second})
	require.NoError(t, err)
	descs, err := cl.Definitions(ctx)
	require.NoError(t, err)
	require.Len(t, descs, 2)
	require.Equal(t, []int{1, 2}, []int{descs[0].Version, descs[1].Version})
	// No worker runs either: the newest recorded is the one to start.
	newest, err := cl.Definition(ctx, def.Name())
	require.NoError(t, err)
	require.Equal(t, 2, newest.Version())
	old, err := cl.DefinitionAt(ctx, def.Name(), 1)
	require.NoError(t, err)
	require.Equal(t, def.Len(), old.Len())
	_, err = cl.DefinitionAt(ctx, def.Name(), 7)
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
	require.ErrorContains(t, err, "transfer@7")

	// A saga started on version 2 through the rebuilt definition records
	// it, and a duplicate start of its key on version 1 finds it.
	res, err := cl.Start(ctx, newest, "v-1", transferInput(1, 2, 3))
	require.NoError(t, err)
	sg, err := cl.Get(ctx, res.ID)
	require.NoError(t, err)
	require.Equal(t, 2, sg.DefinitionVersion)
	dup, err := cl.Start(ctx, old, "v-1", transferInput(1, 2, 3))
	require.NoError(t, err)
	require.True(t, dup.Duplicate)
	require.Equal(t, res.ID, dup.ID)
}
