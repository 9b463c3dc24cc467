package saga_test

import (
	"bytes"
	"compress/gzip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func gzipped(t *testing.T, text string) *bytes.Buffer {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, err := zw.Write([]byte(text))
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return &b
}

// TestReadArchive reads lines in order, and stops at the first bad one
// with its number: not gzip, not JSON, or a format of a later version.
func TestReadArchive(t *testing.T) {
	text := `{"format":1,"saga":{"id":"0195f9a4-7f00-7000-8000-000000000001","key":"a","state":"credited"},"inbox":[{"step":"credit","outcome":"succeeded","unknown":true}]}
{"format":1,"saga":{"id":"0195f9a4-7f00-7000-8000-000000000002","key":"b","state":"compensated"}}
`
	var keys []string
	for a, err := range saga.ReadArchive(gzipped(t, text)) {
		require.NoError(t, err)
		keys = append(keys, a.Saga.Key)
		if a.Saga.Key == "a" {
			require.True(t, a.Inbox[0].Unknown)
		}
	}
	require.Equal(t, []string{"a", "b"}, keys)

	for _, bad := range []struct {
		name string
		file *bytes.Buffer
		want string
	}{
		{"not gzip", bytes.NewBufferString(text), "not a gzip file"},
		{"not JSON", gzipped(t, text+"{nope\n"), "line 3"},
		{"later format", gzipped(t, `{"format":2}`), "line 1: idemsaga: archive line of an unknown format: format 2"},
		{"no format", gzipped(t, `{"saga":{}}`), "format 0"},
	} {
		var err error
		n := 0
		for _, e := range saga.ReadArchive(bad.file) {
			if e != nil {
				err = e
				break
			}
			n++
		}
		require.ErrorContains(t, err, bad.want, bad.name)
		if strings.Contains(bad.want, "format") {
			require.ErrorIs(t, err, saga.ErrArchiveFormat)
		}
	}
}
