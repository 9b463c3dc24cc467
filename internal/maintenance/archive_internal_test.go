package maintenance

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

// TestArchiveNameSortsAndNeverCollides: names sort by time, whatever the
// host and process, and differ for one process at one instant.
func TestArchiveNameSortsAndNeverCollides(t *testing.T) {
	t0 := time.Date(2026, 3, 1, 9, 59, 59, 999_999_999, time.FixedZone("CET", 3600))
	names := []string{
		archiveName(t0, "zz", 9, 1),
		archiveName(t0.Add(time.Nanosecond), "aa", 1, 2),
		archiveName(t0.Add(time.Hour), "mm", 5, 3),
	}
	require.True(t, slices.IsSorted(names), "%v", names)
	require.Equal(t, "sagas-20260301T085959.999999999Z-zz-9-000001.jsonl.gz", names[0], "in UTC")
	require.NotEqual(t, archiveName(t0, "h", 1, 1), archiveName(t0, "h", 1, 2))
	require.Equal(t, "sagas-20260301T085959.999999999Z-a_b.c_d-7-000001.jsonl.gz", archiveName(t0, "a-b.c/d", 7, 1), "a host cannot add a field or a path")
	require.Contains(t, archiveName(t0, "", 7, 1), "-host-7-")
}

// TestWriteArchiveReadsBack: a file written is complete under its final
// name, read back line for line, and nothing else is left in the
// directory.
func TestWriteArchiveReadsBack(t *testing.T) {
	dir := t.TempDir()
	var lines []*saga.ArchivedSaga
	for i := range 3 {
		lines = append(lines, &saga.ArchivedSaga{Format: saga.ArchiveFormat, Saga: saga.Instance{ID: uuid.New(), Key: "k<&>" + string(rune('a'+i)), State: "credited", Input: []byte(`{"to":"<b>"}`)}})
	}
	path, err := writeArchive(dir, lines)
	require.NoError(t, err)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, filepath.Base(path), entries[0].Name())
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var got []*saga.ArchivedSaga
	for a, err := range saga.ReadArchive(f) {
		require.NoError(t, err)
		got = append(got, a)
	}
	require.Equal(t, lines, got)

	second, err := writeArchive(dir, lines)
	require.NoError(t, err)
	require.NotEqual(t, path, second)
	require.Less(t, filepath.Base(path), filepath.Base(second))
}

// TestWriteArchiveUnwritable: a missing directory, or a file in its
// place, is an error that names it and says what to do, and leaves
// nothing behind.
func TestWriteArchiveUnwritable(t *testing.T) {
	base := t.TempDir()
	file := filepath.Join(base, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	for _, dir := range []string{filepath.Join(base, "missing"), file} {
		_, err := writeArchive(dir, []*saga.ArchivedSaga{{Format: saga.ArchiveFormat}})
		require.ErrorContains(t, err, dir)
		require.ErrorContains(t, err, "create the directory and let this process write to it")
		require.Error(t, checkArchiveDir(dir))
	}
	require.NoError(t, checkArchiveDir(base))
	entries, err := os.ReadDir(base)
	require.NoError(t, err)
	require.Len(t, entries, 1, "the check leaves nothing")
}
