package service

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestDeadLettersCommands: a saga's parked command shows in `show`,
// `list --dead-lettered` and `dead-letters list` (with a note that no
// worker runs its version); `dead-letters resend` sends it again through
// the outbox, `dead-letters drop --saga` drops what the saga has, and ids
// that are not parked are refused without changing anything.
func TestDeadLettersCommands(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	ctx := context.Background()
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	out, _, err := runIn(t, admin, "start", "greet", "--key", "g-1", "--input", `{}`)
	require.NoError(t, err)
	id := strings.TrimSpace(out)
	park := func(msgID string) int64 {
		var dl int64
		require.NoError(t, pool.QueryRow(ctx, `insert into idemsaga.dead_letters (msg_id, subject, payload, saga_id, definition, definition_version,
  step, phase, attempt, reason, deliveries, parked_by, first_seen)
select $2, o.subject, o.payload, o.saga_id, 'greet', 1, 'hello', 'forward', 1, 'this worker does not run definition "greet"', 5, 'test', idemsaga.now()
from idemsaga.outbox o where o.saga_id = $1 order by o.id limit 1 returning id`, id, msgID).Scan(&dl))
		return dl
	}
	dl := park("c-first")

	out, errOut, err := runIn(t, admin, "dead-letters", "list")
	require.NoError(t, err)
	require.Regexp(t, fmt.Sprintf(`%d +%s +greet@1 +hello +forward +1 +5 `, dl, id), out)
	require.Contains(t, out, "1 parked commands")
	require.Contains(t, errOut, "no live worker runs greet@1")
	out, _, err = runIn(t, admin, "dead-letters", "list", "--json", "--saga", "g-1")
	require.NoError(t, err)
	var listed []saga.DeadLetter
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	require.Len(t, listed, 1)
	require.Equal(t, 5, listed[0].Deliveries)
	_, _, err = runIn(t, admin, "dead-letters", "list", "--version", "2")
	require.ErrorContains(t, err, "--version 2 needs --definition")

	out, _, err = runIn(t, admin, "show", "g-1")
	require.NoError(t, err)
	require.Contains(t, out, "definition  greet version 1")
	require.Contains(t, out, "parked commands")
	out, errOut, err = runIn(t, admin, "list", "--dead-lettered")
	require.NoError(t, err)
	require.Contains(t, out, id)
	require.Contains(t, errOut, "1 commands are parked as dead letters")

	_, _, err = runIn(t, admin, "dead-letters", "resend", fmt.Sprint(dl), "999999")
	require.ErrorIs(t, err, engine.ErrDeadLetterNotFound)
	out, _, err = runIn(t, admin, "dead-letters", "resend", fmt.Sprint(dl))
	require.NoError(t, err)
	require.Contains(t, out, fmt.Sprintf("resent 1 dead letters: %d", dl))
	var n int
	require.NoError(t, pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where msg_id = $1 and published_at is null`, fmt.Sprintf("c-first-dl%d", dl)).Scan(&n))
	require.Equal(t, 1, n, "the command waits in the outbox for the relay")

	park("c-second")
	park("c-third")
	_, _, err = runIn(t, admin, "dead-letters", "drop")
	require.ErrorContains(t, err, "give dead-letter ids or --saga")
	out, _, err = runIn(t, admin, "dead-letters", "drop", "--saga", "g-1")
	require.NoError(t, err)
	require.Contains(t, out, "dropped 2 dead letters")
	_, _, err = runIn(t, admin, "dead-letters", "drop", "--saga", "g-1")
	require.ErrorIs(t, err, engine.ErrDeadLetterNotFound)
	out, _, err = runIn(t, admin, "dead-letters")
	require.NoError(t, err)
	require.Contains(t, out, "0 parked commands")
}
