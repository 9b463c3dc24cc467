package store

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
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
		r := &Record{}
		for _, name := range st.names {
			require.NotPanics(t, func() { r.arg(name, sh.locked) }, "shape %+v: parameter %s", sh, name)
		}
	}
	// The shapes the engine builds are all there.
	for _, lead := range []Lead{LeadNone, LeadFailure, LeadFailureAlone, LeadExternal} {
		for _, sh := range []shape{{lead: lead}, {lead: lead, reply: true}, {lead: lead, move: true, reply: true}, {lead: lead, move: true, next: true, reply: true},
			{lead: lead, move: true, next: true, command: true, reply: true}} {
			_, ok := statements[sh]
			require.True(t, ok, fmt.Sprintf("%+v", sh))
		}
	}
	for _, sh := range []shape{{move: true, locked: true}, {move: true, next: true, locked: true}, {move: true, next: true, command: true, locked: true}} {
		_, ok := statements[sh]
		require.True(t, ok, fmt.Sprintf("%+v", sh))
	}
}
