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
