package service

import (
	"compress/gzip"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// writeArchiveFile writes lines as an archive file (gzip-compressed
// JSON Lines) named name in dir.
func writeArchiveFile(t *testing.T, dir, name string, lines ...saga.ArchivedSaga) string {
	t.Helper()
	path := filepath.Join(dir, name)
	f, err := os.Create(path)
	require.NoError(t, err)
	zw := gzip.NewWriter(f)
	enc := json.NewEncoder(zw)
	for _, l := range lines {
		require.NoError(t, enc.Encode(l))
	}
	require.NoError(t, zw.Close())
	require.NoError(t, f.Close())
	return path
}

// TestShowArchive: show --archive prints an archived saga as show printed
// it live (the same printer, the plan from the archived description),
// by key or ID, from a file that holds it twice, with no database; an
// unknown saga is an error naming the file, and a key of two definitions
// asks for the ID.
func TestShowArchive(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	admin := Config{Name: "shopadmin"}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	_, _, err = runIn(t, admin, "start", "greet", "--key", "g-1", "--input", `{"name":"ann"}`)
	require.NoError(t, err)
	_, _, err = runIn(t, admin, "skip", "g-1", "--step", "hello", "--reason", "greeted by phone", "--by", "ann")
	require.NoError(t, err)
	_, _, err = runIn(t, admin, "skip", "g-1", "--step", "bye", "--reason", "left already", "--by", "bob")
	require.NoError(t, err)
	live, _, err := runIn(t, admin, "show", "g-1")
	require.NoError(t, err)
	require.Contains(t, live, "finished")
	require.Regexp(t, `skip\s+bye/forward\s+cli:bob`, live)
	js, _, err := runIn(t, admin, "show", "g-1", "--json")
	require.NoError(t, err)
	var sg saga.Instance
	require.NoError(t, json.Unmarshal([]byte(js), &sg))

	// JSON in a line is compact, where PostgreSQL's jsonb prints spaces.
	live = strings.Replace(live, `{"name": "ann"}`, `{"name":"ann"}`, 1)

	desc := greetDefinition().Describe()
	line := saga.ArchivedSaga{Format: saga.ArchiveFormat, Saga: sg, Description: &desc, InputHash: []byte{1}}
	other := saga.ArchivedSaga{Format: saga.ArchiveFormat, Saga: saga.Instance{ID: [16]byte{1}, Definition: "greet", Key: "g-2", State: "byed"}}
	dir := t.TempDir()
	file := writeArchiveFile(t, dir, "sagas-1.jsonl.gz", other, line, line)
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none?sslmode=disable") // no database from here on

	for _, arg := range []string{"g-1", sg.ID.String()} {
		out, _, err := runIn(t, admin, "show", "--archive", file, arg)
		require.NoError(t, err, arg)
		require.True(t, strings.HasPrefix(out, live), "printed as live:\n%s\nlive:\n%s", out, live)
		require.Contains(t, out[len(live):], "archived 0001-01-01T00:00:00Z in "+file)
	}
	out, _, err := runIn(t, admin, "show", "--archive", file, "g-1", "--json")
	require.NoError(t, err)
	var got saga.ArchivedSaga
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Equal(t, sg.ID, got.Saga.ID)
	require.Len(t, got.Saga.Repairs, 2)
	require.Equal(t, []byte{1}, got.InputHash)

	_, _, err = runIn(t, admin, "show", "--archive", file, "g-9")
	require.ErrorIs(t, err, saga.ErrNotFound)
	require.ErrorContains(t, err, `no saga has ID or key "g-9" in the archive `+file)

	twin := line
	twin.Saga.ID, twin.Saga.Definition = [16]byte{2}, "wave"
	both := writeArchiveFile(t, dir, "sagas-2.jsonl.gz", line, twin)
	_, _, err = runIn(t, admin, "show", "--archive", both, "g-1")
	require.ErrorContains(t, err, "several definitions")
	require.ErrorContains(t, err, "use the saga ID")

	notGzip := filepath.Join(dir, "plain.jsonl")
	require.NoError(t, os.WriteFile(notGzip, []byte("{}\n"), 0o600))
	_, _, err = runIn(t, admin, "show", "--archive", notGzip, "g-1")
	require.ErrorContains(t, err, "not a gzip file")
	require.ErrorContains(t, err, notGzip)
}
