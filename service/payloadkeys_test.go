package service

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestPayloadKeysFromTheCLI: with --payload-keys-file a start keeps its
// input sealed; show opens it with the keys and shows it sealed without
// them; a missing or malformed keys file is an error that names the file
// or the line, never a key.
func TestPayloadKeysFromTheCLI(t *testing.T) {
	pool, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)

	dir := t.TempDir()
	secret := make([]byte, 32)
	_, err = rand.Read(secret)
	require.NoError(t, err)
	keys := filepath.Join(dir, "keys")
	require.NoError(t, os.WriteFile(keys, []byte("# current first\nk1 "+base64.StdEncoding.EncodeToString(secret)+"\n"), 0o600))

	_, _, err = runIn(t, admin, "--payload-keys-file", keys, "start", "greet", "--key", "p-1", "--input", `{"name":"MARKER-ann"}`)
	require.NoError(t, err)
	var stored string
	require.NoError(t, pool.QueryRow(context.Background(), `select input::text from idemsaga.sagas where idem_key = 'p-1'`).Scan(&stored))
	require.NotContains(t, stored, "MARKER")
	require.Contains(t, stored, "idemsaga:sealed:")

	out, _, err := runIn(t, admin, "--payload-keys-file", keys, "show", "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "MARKER-ann", "opened with the keys")
	out, _, err = runIn(t, admin, "show", "p-1")
	require.NoError(t, err)
	require.NotContains(t, out, "MARKER-ann", "without the keys, shown sealed")

	// An archived saga is kept sealed; show --archive opens it with the
	// keys.
	js, _, err := runIn(t, admin, "show", "p-1", "--json")
	require.NoError(t, err)
	var sealed saga.Instance
	require.NoError(t, json.Unmarshal([]byte(js), &sealed))
	require.NotContains(t, string(sealed.Input), "MARKER")
	file := writeArchiveFile(t, dir, "sagas-1.jsonl.gz", saga.ArchivedSaga{Format: saga.ArchiveFormat, Saga: sealed})
	out, _, err = runIn(t, admin, "--payload-keys-file", keys, "show", "--archive", file, "p-1")
	require.NoError(t, err)
	require.Contains(t, out, "MARKER-ann")
	out, _, err = runIn(t, admin, "show", "--archive", file, "p-1")
	require.NoError(t, err)
	require.NotContains(t, out, "MARKER-ann")

	_, _, err = runIn(t, admin, "--payload-keys-file", filepath.Join(dir, "nope"), "show", "p-1")
	require.ErrorContains(t, err, filepath.Join(dir, "nope"))
	bad := filepath.Join(dir, "bad")
	require.NoError(t, os.WriteFile(bad, []byte("k1 "+base64.StdEncoding.EncodeToString(secret[:16])+"\n"), 0o600))
	_, _, err = runIn(t, admin, "--payload-keys-file", bad, "show", "p-1")
	require.ErrorContains(t, err, `key "k1": the secret is 16 bytes`)
	require.ErrorContains(t, err, bad)
	require.NotContains(t, err.Error(), base64.StdEncoding.EncodeToString(secret[:16]))
}
