package store_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// fixture is a saga started by the store's own statement, its first step
// "a" dispatched at attempt 1.
type fixture struct {
	pool *pgxpool.Pool
	id   uuid.UUID
	// version is the saga's as started.
	version int64
}

func newFixture(t testing.TB, pool *pgxpool.Pool) fixture {
	t.Helper()
	id := uuid.New()
	var n int64
	var outboxID *int64
	var existing *uuid.UUID
	var hash []byte
	var state *string
	var got bool
	err := pool.QueryRow(context.Background(), store.StartSaga, pguuid.Of(id), "fixture", id.String(), []byte("h"), "{}",
		"a", pguuid.Of(saga.StepKey(id, "a", saga.PhaseForward)), int64(60000), nil, 1, nil, nil, "cmd.a", id.String()+"-a-1", []byte("a"), nil,
	).Scan(&n, &outboxID, &existing, &hash, &state, &got)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.True(t, got)
	f := fixture{pool: pool, id: id}
	_, f.version, _ = f.state(t)
	return f
}

// move is the fixture's first step's success, moving the saga from init
// to a_done and dispatching step b.
func (f fixture) move(version int64) *store.Move {
	return &store.Move{
		Saga: f.id, Definition: "fixture", From: "init", Version: version, To: "a_done",
		Step: "a", Phase: saga.PhaseForward, Attempt: 1, Status: saga.StepSucceeded, StepResult: []byte(`{"ok":true}`),
		ResultStep: "a", Result: []byte(`{"ok":true}`),
		Next: &store.Dispatch{Step: "b", Phase: saga.PhaseForward, Index: 1, Key: saga.StepKey(f.id, "b", saga.PhaseForward),
			LeaseMillis: 60000, Subject: "cmd.b", MsgID: f.id.String() + "-b-1", Payload: []byte("b")},
	}
}

func (f fixture) record(t *testing.T, r *store.Record) (store.Recorded, []outbox.Committed, error) {
	t.Helper()
	ctx := context.Background()
	conn, err := f.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx := store.Begin(conn.Conn(), nil)
	defer tx.Rollback(ctx)
	var out store.Recorded
	store.QueueRecord(tx, r, &out)
	if err := tx.Commit(ctx); err != nil {
		return out, nil, err
	}
	return out, tx.Published(), nil
}

func (f fixture) state(t testing.TB) (state string, version int64, steps int) {
	t.Helper()
	require.NoError(t, f.pool.QueryRow(context.Background(),
		`select state::text, version, (select count(*) from idemsaga.steps where saga_id = $1) from idemsaga.sagas where id = $1`,
		pguuid.Of(f.id)).Scan(&state, &version, &steps))
	return state, version, steps
}

func TestRecordAppliesAMoveFencedByVersion(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testenv.DB(t))
	reply := &outbox.Message{Subject: "reply", MsgID: f.id.String() + "-reply", Payload: []byte("r")}

	// A command written at another version misses: the saga stays, and the
	// reply goes out instead, for the orchestrator to decide.
	out, sent, err := f.record(t, &store.Record{Saga: f.id, Key: saga.StepKey(f.id, "a", saga.PhaseForward), Step: "a", Phase: saga.PhaseForward, Attempt: 1,
		Move: f.move(f.version + 7), Reply: reply})
	require.NoError(t, err)
	require.True(t, out.Led)
	require.False(t, out.Moved)
	require.NotNil(t, out.ReplyID)
	require.Nil(t, out.NextID)
	require.Len(t, sent, 1)
	require.Equal(t, "reply", sent[0].Subject)
	st, v, n := f.state(t)
	require.Equal(t, "init", st)
	require.Equal(t, f.version, v)
	require.Equal(t, 1, n)

	// At its version the move applies, dispatches b with its command, and
	// writes no reply.
	out, sent, err = f.record(t, &store.Record{Saga: f.id, Key: saga.StepKey(f.id, "a", saga.PhaseForward), Step: "a", Phase: saga.PhaseForward, Attempt: 1,
		Move: f.move(f.version), Reply: reply})
	require.NoError(t, err)
	require.True(t, out.Moved)
	require.True(t, out.Dispatched)
	require.NotNil(t, out.NextID)
	require.Nil(t, out.ReplyID)
	require.Len(t, sent, 1)
	require.Equal(t, "cmd.b", sent[0].Subject)
	st, v, n = f.state(t)
	require.Equal(t, "a_done", st)
	require.Equal(t, f.version+1, v)
	require.Equal(t, 2, n)
}

func TestRecordEagerDispatchWritesNoCommand(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testenv.DB(t))
	out, sent, err := f.record(t, &store.Record{Saga: f.id, Key: saga.StepKey(f.id, "a", saga.PhaseForward), Step: "a", Phase: saga.PhaseForward, Attempt: 1,
		Move: f.move(f.version), Eager: true})
	require.NoError(t, err)
	require.True(t, out.Moved)
	require.True(t, out.Dispatched)
	require.Nil(t, out.NextID)
	require.Empty(t, sent)
	var rows int
	require.NoError(t, f.pool.QueryRow(context.Background(), `select count(*) from idemsaga.outbox where saga_id = $1 and subject = 'cmd.b'`, pguuid.Of(f.id)).Scan(&rows))
	require.Zero(t, rows)
}

func TestMoveUnderLockThatMissesIsABug(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testenv.DB(t))
	ctx := context.Background()
	conn, err := f.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx := store.Begin(conn.Conn(), nil)
	defer tx.Rollback(ctx)
	store.QueueMove(tx, f.move(f.version+3), nil, nil)
	err = tx.Commit(ctx)
	require.ErrorIs(t, err, store.ErrInvariant)
	st, v, n := f.state(t)
	require.Equal(t, "init", st)
	require.Equal(t, f.version, v)
	require.Equal(t, 1, n)
}

func TestFailureLeadsWriteOnlyWhereTheKeyAllows(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testenv.DB(t))
	key := saga.StepKey(f.id, "a", saga.PhaseForward)
	// LeadFailure ends the attempt's own claim: without one, nothing.
	out, _, err := f.record(t, &store.Record{Lead: store.LeadFailure, Saga: f.id, Key: key, Step: "a", Phase: saga.PhaseForward, Attempt: 1,
		InboxOutcome: "retry", ErrText: "boom"})
	require.NoError(t, err)
	require.False(t, out.Led)

	// LeadFailureAlone inserts the key's row, and a second record of the
	// same attempt writes nothing: the first outcome stands.
	for i, want := range []bool{true, false} {
		out, _, err = f.record(t, &store.Record{Lead: store.LeadFailureAlone, Saga: f.id, Key: key, Step: "a", Phase: saga.PhaseForward, Attempt: 1,
			InboxOutcome: "retry", ErrText: "boom"})
		require.NoError(t, err)
		require.Equal(t, want, out.Led, "record %d", i)
	}
	// A later attempt takes the key from the retry.
	out, _, err = f.record(t, &store.Record{Lead: store.LeadFailureAlone, Saga: f.id, Key: key, Step: "a", Phase: saga.PhaseForward, Attempt: 2,
		InboxOutcome: "failed", ErrText: "for good"})
	require.NoError(t, err)
	require.True(t, out.Led)
	var outcome string
	var attempt int
	require.NoError(t, f.pool.QueryRow(context.Background(), `select outcome::text, attempt from idemsaga.inbox where saga_id = $1 and step_key = $2`,
		pguuid.Of(f.id), pguuid.Of(key)).Scan(&outcome, &attempt))
	require.Equal(t, "failed", outcome)
	require.Equal(t, 2, attempt)
}
