package httpapi_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

func TestUnquoteKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		`T-1`: `T-1`, `"T-1"`: `T-1`, `"a\"b"`: `a"b`, `"a\\b"`: `a\b`, `""`: ``, `a"b`: `a"b`, `" x "`: ` x `,
	} {
		got, ok := httpapi.UnquoteKey(in)
		require.True(t, ok, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{`"`, `"abc`, `"a"b"`, `"a\b"`, `"a\"`, `"a";p=1`, "\"a\tb\"", "\"caf\xc3\xa9\""} {
		_, ok := httpapi.UnquoteKey(in)
		require.False(t, ok, in)
	}
}

// FuzzUnquoteKey: quoting a key as an sf-string and unquoting it gives
// it back.
func FuzzUnquoteKey(f *testing.F) {
	for _, s := range []string{"T-1", `a"b\c`, " ", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, key string) {
		for i := 0; i < len(key); i++ {
			if key[i] < 0x20 || key[i] > 0x7e {
				return
			}
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		got, ok := httpapi.UnquoteKey(quoted)
		require.True(t, ok, quoted)
		require.Equal(t, key, got)
	})
}
