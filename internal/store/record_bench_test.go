package store_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// BenchmarkRecordSuccess is a database step's success applied in its own
// transaction, dispatching the next step, eagerly or through the outbox:
// the engine's hottest statement. Each iteration starts its saga first.
func BenchmarkRecordSuccess(b *testing.B) {
	for _, eager := range []bool{true, false} {
		name := "outbox"
		if eager {
			name = "eager"
		}
		b.Run(name, func(b *testing.B) {
			pool := testenv.DB(b)
			ctx := context.Background()
			conn, err := pool.Acquire(ctx)
			require.NoError(b, err)
			defer conn.Release()
			for b.Loop() {
				f := newFixture(b, pool)
				tx := store.Begin(conn.Conn(), nil)
				var out store.Recorded
				store.QueueRecord(tx, &store.Record{Saga: f.id, Key: saga.StepKey(f.id, "a", saga.PhaseForward), Step: "a", Phase: saga.PhaseForward,
					Attempt: 1, Result: []byte(`{"ok":true}`), Move: f.move(f.version), Eager: eager}, &out)
				if err := tx.Commit(ctx); err != nil || !out.Moved {
					b.Fatal(err, out.Moved)
				}
			}
		})
	}
}
