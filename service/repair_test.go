package service

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestRepairCommands: skip, close and the bulk forms of the repairs, from
// an admin binary with no worker running; show lists the repairs.
func TestRepairCommands(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	for _, k := range []string{"g-1", "g-2", "g-3"} {
		_, _, err := runIn(t, admin, "start", "greet", "--key", k, "--input", `{}`)
		require.NoError(t, err)
	}

	_, _, err = runIn(t, admin, "skip", "g-1", "--step", "hello", "--result", `{"n":1,"n":2}`)
	require.ErrorContains(t, err, "invalid step result")
	out, _, err := runIn(t, admin, "skip", "g-1", "--step", "hello", "--result", `{"n":1}`, "--reason", "greeted by phone", "--by", "ann", "--request-key", "s-1")
	require.NoError(t, err)
	require.Contains(t, out, "step skipped; now helloed (request key s-1)")
	out, _, err = runIn(t, admin, "show", "g-1")
	require.NoError(t, err)
	require.Contains(t, out, "repairs:")
	require.Regexp(t, `skip\s+hello/forward\s+cli:ann\s+helloed\s+s-1\s+greeted by phone`, out)
	require.Regexp(t, `plan\s+hello succeeded → bye dispatched\n`, out, "the plan, from the deployment's record of the definition")
	out, _, err = runIn(t, admin, "show", "g-1", "--json")
	require.NoError(t, err)
	var shown saga.Instance
	require.NoError(t, json.Unmarshal([]byte(out), &shown))
	require.Len(t, shown.Repairs, 1)
	require.Equal(t, "skip", shown.Repairs[0].Operation)
	require.JSONEq(t, `{"n":1}`, string(shown.Results["hello"]))

	_, _, err = runIn(t, admin, "close", "g-2")
	require.ErrorContains(t, err, "only a failed or parked saga can be closed")
	_, _, err = runIn(t, admin, "close", "g-2", "--state", "init")
	require.ErrorContains(t, err, "not both")
	_, _, err = runIn(t, admin, "close")
	require.ErrorContains(t, err, "--dry-run first")

	out, _, err = runIn(t, admin, "cancel", "--state", "init", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run, nothing changed: 2 sagas, 2 would be cancelled, 0 refused")
	require.Contains(t, out, "WOULD BE")
	out, _, err = runIn(t, admin, "cancel", "--state", "init", "--request-key", "bulk-1", "--json")
	require.NoError(t, err)
	var bulk struct {
		Key   string `json:"key"`
		Items []struct {
			Before   string `json:"before"`
			State    string `json:"state"`
			Replayed bool   `json:"replayed"`
			Error    string `json:"error"`
		} `json:"items"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &bulk))
	require.Equal(t, "bulk-1", bulk.Key)
	require.Len(t, bulk.Items, 2)
	for _, it := range bulk.Items {
		require.Equal(t, "init", it.Before)
		require.Equal(t, "compensated", it.State)
		require.False(t, it.Replayed)
	}
	// The same request again, for the sagas it cancelled: replayed.
	out, _, err = runIn(t, admin, "cancel", "--state", "compensated", "--request-key", "bulk-1")
	require.NoError(t, err)
	require.Contains(t, out, "already done by this request")
	require.Contains(t, out, "2 sagas: 2 cancelled, 0 refused")
	// One saga refused does not hold up the others; the command says so.
	out, _, err = runIn(t, admin, "close", "--definition", "greet")
	require.ErrorContains(t, err, "3 of 3 sagas were refused")
	require.Contains(t, out, "refused: ")
}
