package store_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/startlock"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestStartStatements runs every shape of the start statement: each
// inserts its saga, and its first step's row and command only when it
// has a command (a carried start leaves both to its attempt, whose
// QueueFirstStep writes the row once), answers a second start of its key
// as a duplicate, and, locked
// while another transaction holds the key's lock, writes nothing and
// says so.
func TestStartStatements(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	for _, token := range []bool{false, true} {
		for _, locked := range []bool{false, true} {
			for _, command := range []bool{false, true} {
				name := fmt.Sprintf("token=%v,locked=%v,command=%v", token, locked, command)
				stmt := store.StartStatement(token, locked, command)
				key := "key-" + name
				if token {
					_, err := pool.Exec(ctx, store.InsertSubmitToken, key, "fixture", int64(60000))
					require.NoError(t, err, name)
				}
				type answer struct {
					inserted int
					outboxID *int64
					existing *uuid.UUID
					got      bool
				}
				start := func(id uuid.UUID) answer {
					var a answer
					var hash []byte
					var state *string
					var lock any
					if locked {
						lock = startlock.ID("fixture", key)
					}
					args := []any{pguuid.Of(id), "fixture", key, []byte("h"), "{}", nil, 1, nil, lock}
					if command {
						args = slices.Insert(args, 5, any("a"), any(pguuid.Of(saga.StepKey(id, "a", saga.PhaseForward))), any(int64(60000)))
						args = append(args, "cmd.a", id.String()+"-a-1", []byte("a"), nil)
					}
					require.NoError(t, pool.QueryRow(ctx, stmt, args...).Scan(&a.inserted, &a.outboxID, &a.existing, &hash, &state, &a.got), name)
					return a
				}
				if locked {
					// Held by another transaction: nothing written.
					tx, err := pool.Begin(ctx)
					require.NoError(t, err)
					_, err = tx.Exec(ctx, `select pg_advisory_xact_lock($1)`, startlock.ID("fixture", key))
					require.NoError(t, err)
					a := start(uuid.New())
					require.NoError(t, tx.Rollback(ctx))
					require.False(t, a.got, name)
					require.Zero(t, a.inserted, name)
					require.Zero(t, countOf(t, pool, `select count(*) from idemsaga.sagas where idem_key = $1`, key), name)
				}
				id := uuid.New()
				a := start(id)
				require.True(t, a.got, name)
				require.Equal(t, 1, a.inserted, name)
				require.Equal(t, command, a.outboxID != nil, name)
				want := 0
				if command {
					want = 1
				}
				dispatched := `select count(*) from idemsaga.steps where saga_id = $1 and step = 'a' and status = 'dispatched' and attempt = 1 and lease_until is not null`
				require.Equal(t, want, countOf(t, pool, dispatched, id), name)
				require.Equal(t, want, countOf(t, pool, `select count(*) from idemsaga.outbox where saga_id = $1`, id), name)
				if !command {
					// The row the start left out, written twice: once.
					first := store.FirstStep{Saga: id, Step: "a", Key: saga.StepKey(id, "a", saga.PhaseForward), LeaseMillis: 60000}
					for range 2 {
						conn, err := pool.Acquire(ctx)
						require.NoError(t, err)
						tx := store.Begin(conn.Conn(), nil)
						store.QueueFirstStep(tx, first)
						require.NoError(t, tx.Commit(ctx), name)
						conn.Release()
					}
					require.Equal(t, 1, countOf(t, pool, dispatched, id), name)
				}

				again := start(uuid.New())
				require.True(t, again.got, name)
				require.Zero(t, again.inserted, name)
				require.NotNil(t, again.existing, name)
				require.Equal(t, id, *again.existing, name)
			}
		}
	}
}

func countOf(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
