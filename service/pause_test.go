package service

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestPauseAndResumeCommands: pause and resume one saga, then its whole
// definition, from an admin binary; show says why the saga is held.
func TestPauseAndResumeCommands(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	out, _, err := runIn(t, admin, "start", "greet", "--key", "g-1", "--input", `{}`)
	require.NoError(t, err)
	id := out[:36]

	_, _, err = runIn(t, admin, "pause")
	require.ErrorContains(t, err, "name one saga")
	out, _, err = runIn(t, admin, "pause", "g-1", "--reason", "mail down", "--request-key", "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "saga "+id+": paused")
	out, _, err = runIn(t, admin, "pause", "g-1", "--reason", "mail down", "--request-key", "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "already paused by this request (key p-1)")
	out, _, err = runIn(t, admin, "show", "g-1")
	require.NoError(t, err)
	require.Contains(t, out, "paused")
	require.Contains(t, out, "`resume "+id+"`")
	out, _, err = runIn(t, admin, "resume", id)
	require.NoError(t, err)
	require.Contains(t, out, "resumed from its pause")

	out, _, err = runIn(t, admin, "pause", "--definition", "greet", "--reason", "mail down", "--by", "ann")
	require.NoError(t, err)
	require.Contains(t, out, "definition greet: paused")
	require.Contains(t, out, "1 running sagas")
	out, _, err = runIn(t, admin, "show", "g-1")
	require.NoError(t, err)
	require.Contains(t, out, "with its definition (`resume --definition greet`)")
	_, _, err = runIn(t, admin, "pause", "--definition", "greet")
	require.ErrorContains(t, err, `paused already`)
	require.ErrorContains(t, err, `by "cli:ann" (mail down)`)
	out, _, err = runIn(t, admin, "resume", "--definition", "greet")
	require.NoError(t, err)
	require.Contains(t, out, "definition greet: resumed")
	_, _, err = runIn(t, admin, "resume", "--definition", "nope")
	require.ErrorIs(t, err, saga.ErrUnknownDefinition)
}
