package store

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// TestEveryRecordStatementPrepares prepares every statement a record can
// take, so that a shape the engine rarely builds (a failure whose move
// has no next step, a lock-held move's last step) cannot carry a typo to
// production.
func TestEveryRecordStatementPrepares(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	require.NotEmpty(t, statements)
	for sh, st := range statements {
		_, err := conn.Conn().Prepare(ctx, "", st.sql)
		require.NoError(t, err, "shape %+v:\n%s", sh, st.sql)
		// A record of that shape takes that statement, and every one of
		// its parameters finds what it reads.
		r := recordOf(sh)
		var sql string
		var args []any
		require.NotPanics(t, func() { sql, args = r.statement(sh.locked) }, "shape %+v", sh)
		require.Equal(t, st.sql, sql, "shape %+v", sh)
		require.Len(t, args, len(st.params))
	}
	// The shapes the engine builds are all there.
	for _, lead := range []Lead{LeadNone, LeadFailure, LeadFailureAlone, LeadExternal} {
		for _, sh := range []shape{{lead: lead}, {lead: lead, reply: true}, {lead: lead, move: true, reply: true}, {lead: lead, move: true, next: true, reply: true},
			{lead: lead, move: true, next: true, command: true, reply: true}} {
			_, ok := statements[sh]
			require.True(t, ok, fmt.Sprintf("%+v", sh))
		}
	}
	for _, sh := range []shape{{move: true, locked: true}, {move: true, next: true, locked: true}, {move: true, next: true, command: true, locked: true},
		{move: true, first: true}, {move: true, next: true, first: true, keep: true}, {move: true, next: true, command: true, first: true, keep: true}} {
		_, ok := statements[sh]
		require.True(t, ok, fmt.Sprintf("%+v", sh))
	}
}

// recordOf returns a record of shape sh.
func recordOf(sh shape) *Record {
	r := &Record{Lead: sh.lead, Saga: uuid.New(), Key: uuid.New(), Step: "a", Phase: saga.PhaseForward, Attempt: 1, Eager: !sh.command}
	if sh.move {
		r.Move = &Move{Saga: r.Saga, From: "init", To: "a_done", Step: "a", Phase: saga.PhaseForward, Attempt: 1, Status: saga.StepSucceeded, First: sh.first}
	}
	if sh.next {
		r.Move.Next = &Dispatch{Step: "b", Phase: saga.PhaseForward, Index: 1, Key: uuid.New()}
	}
	if sh.reply {
		r.Reply = &outbox.Message{Subject: "reply"}
	}
	if sh.keep {
		r.Result = []byte(`{}`)
	}
	return r
}
