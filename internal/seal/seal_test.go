package seal_test

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/seal"
)

func key(t *testing.T, id string) seal.Key {
	t.Helper()
	b := make([]byte, 32)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return seal.Key{ID: id, Secret: b}
}

// TestSealOpen: a sealed value is a JSON string that holds nothing of the
// plain value, opens for its saga only, and does not open once altered.
func TestSealOpen(t *testing.T) {
	t.Parallel()
	c, err := seal.NewAESGCM([]seal.Key{key(t, "k1")})
	require.NoError(t, err)
	s := seal.New(c)
	id, other := uuid.New(), uuid.New()
	plain := json.RawMessage(`{"card":"4111111111111111"}`)
	sealed, err := s.Seal(id, plain)
	require.NoError(t, err)
	require.True(t, seal.Sealed(sealed))
	var str string
	require.NoError(t, json.Unmarshal(sealed, &str), "a JSON string, for any jsonb column")
	require.NotContains(t, string(sealed), "4111")
	again, err := s.Seal(id, plain)
	require.NoError(t, err)
	require.NotEqual(t, sealed, again, "a fresh nonce each time")
	got, err := s.Open(id, sealed)
	require.NoError(t, err)
	require.Equal(t, plain, got)
	_, err = s.Open(other, sealed)
	require.ErrorIs(t, err, seal.ErrOpen, "bound to its saga")
	altered := bytes.Clone(sealed)
	altered[len(altered)-3] ^= 1
	_, err = s.Open(id, altered)
	require.ErrorIs(t, err, seal.ErrOpen)

	// Plain data from before the codec is read as it is; a process
	// without the codec cannot open sealed data and says so.
	got, err = s.Open(id, plain)
	require.NoError(t, err)
	require.Equal(t, plain, got)
	_, err = seal.New(nil).Open(id, sealed)
	require.ErrorContains(t, err, "sealed by a codec this process does not have")
	same, err := seal.New(nil).Seal(id, plain)
	require.NoError(t, err)
	require.Equal(t, plain, same, "no codec: kept as given")
}

// TestRotation: the first key seals, every key opens; a value whose key
// left the keyring names it.
func TestRotation(t *testing.T) {
	t.Parallel()
	k1, k2 := key(t, "k1"), key(t, "k2")
	old, err := seal.NewAESGCM([]seal.Key{k1})
	require.NoError(t, err)
	rotated, err := seal.NewAESGCM([]seal.Key{k2, k1})
	require.NoError(t, err)
	only, err := seal.NewAESGCM([]seal.Key{k2})
	require.NoError(t, err)
	id := uuid.New()
	v1, err := seal.New(old).Seal(id, json.RawMessage(`1`))
	require.NoError(t, err)
	v2, err := seal.New(rotated).Seal(id, json.RawMessage(`2`))
	require.NoError(t, err)
	for v, want := range map[string]string{string(v1): "1", string(v2): "2"} {
		got, err := seal.New(rotated).Open(id, json.RawMessage(v))
		require.NoError(t, err)
		require.Equal(t, want, string(got))
	}
	_, err = seal.New(old).Open(id, v2)
	require.ErrorContains(t, err, `sealed with key "k2", which is not in the keyring (k1)`)
	_, err = seal.New(only).Open(id, v1)
	require.ErrorContains(t, err, `key "k1"`)
}

// TestConcurrentSeal: one sealer serves many goroutines.
func TestConcurrentSeal(t *testing.T) {
	t.Parallel()
	c, err := seal.NewAESGCM([]seal.Key{key(t, "k")})
	require.NoError(t, err)
	s := seal.New(c)
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			id := uuid.New()
			plain := json.RawMessage(`{"n":` + strings.Repeat("1", i+1) + `}`)
			v, err := s.Seal(id, plain)
			require.NoError(t, err)
			got, err := s.Open(id, v)
			require.NoError(t, err)
			require.Equal(t, plain, got)
		})
	}
	wg.Wait()
}

// TestParseKeys: errors name the line, never a secret.
func TestParseKeys(t *testing.T) {
	t.Parallel()
	secret := base64.StdEncoding.EncodeToString(make([]byte, 32))
	short := base64.StdEncoding.EncodeToString([]byte("0123456789abcdef"))
	for text, want := range map[string]string{
		"":                                "no key found",
		"k1\n":                            "line 1 has 1 fields",
		"k1 not-base64!\n":                "line 1: the secret is not standard base64",
		"k1 " + short + "\n":              `key "k1": the secret is 16 bytes`,
		"k1 " + secret + "\nk1 " + secret: `the ID "k1" is given twice`,
		"k/1 " + secret:                   `its ID "k/1"`,
	} {
		_, err := seal.ParseKeys(text)
		require.ErrorContains(t, err, want, text)
		require.NotContains(t, err.Error(), secret)
	}
	keys, err := seal.ParseKeys("# current first\nk2 " + secret + "\n\nk1 " + secret + "\n")
	require.NoError(t, err)
	require.Equal(t, []string{"k2", "k1"}, []string{keys[0].ID, keys[1].ID})
}
