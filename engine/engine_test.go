package engine_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestTransferCreditsAndCompensates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := transferDef(t)
	seeded, err := fixture.Seed(ctx, pool, 10, 1000, 10)
	require.NoError(t, err)
	e := startEngine(t, pool, nc, testenv.Name("XFER"), []*saga.Definition{def})

	ok, err := e.Client().Start(ctx, def, "ok", transferInput(1, 2, 100))
	require.NoError(t, err)
	frozen, err := e.Client().Start(ctx, def, "frozen", transferInput(3, 10, 100))
	require.NoError(t, err)
	broke, err := e.Client().Start(ctx, def, "broke", transferInput(4, 5, 5000))
	require.NoError(t, err)

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got, err := e.Client().Wait(wctx, ok.ID)
	require.NoError(t, err)
	require.Equal(t, fixture.StateCredited, got.State)
	got, err = e.Client().Wait(wctx, frozen.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, got.State)
	require.Contains(t, got.Error, "destination account missing or frozen")
	got, err = e.Client().Wait(wctx, broke.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, got.State)
	require.Contains(t, got.Error, "insufficient funds")

	rep, err := fixture.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	var b1, b2, b3 int64
	require.NoError(t, pool.QueryRow(ctx, `select (select balance from fixture.accounts where id=1), (select balance from fixture.accounts where id=2), (select balance from fixture.accounts where id=3)`).Scan(&b1, &b2, &b3))
	require.Equal(t, []int64{900, 1100, 1000}, []int64{b1, b2, b3})
}
