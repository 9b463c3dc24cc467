package engine_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// BenchmarkStart measures Client.Start of a new saga: one statement, its
// own transaction, with its commit's WAL flush.
func BenchmarkStart(b *testing.B) {
	ctx := context.Background()
	pool := testenv.DB(b)
	def := transferDef(b)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(b, err)
	i := 0
	for b.Loop() {
		i++
		if _, err := cl.Start(ctx, def, fmt.Sprintf("bench-%d", i), transferInput(1, 2, 10)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStartDuplicate measures Client.Start under a key whose saga
// exists with the same input: a client's retry.
func BenchmarkStartDuplicate(b *testing.B) {
	ctx := context.Background()
	pool := testenv.DB(b)
	def := transferDef(b)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}})
	require.NoError(b, err)
	_, err = cl.Start(ctx, def, "retried", transferInput(1, 2, 10))
	require.NoError(b, err)
	for b.Loop() {
		res, err := cl.Start(ctx, def, "retried", transferInput(1, 2, 10))
		if err != nil || !res.Duplicate {
			b.Fatal(res, err)
		}
	}
}
