package seal

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/google/uuid"
)

// Key is one key of an AES-GCM keyring: its ID, kept with each value it
// seals, and its 32-byte secret (AES-256).
type Key struct {
	ID     string
	Secret []byte
}

var keyID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,32}$`)

// aesGCM seals with its first key and opens with any of its keys.
type aesGCM struct {
	ids   []string
	aeads map[string]cipher.AEAD
}

// format is the first byte of a value sealed by aesGCM.
const format = 1

// NewAESGCM returns a codec that seals with AES-256-GCM under keys[0] and
// opens what any of keys sealed: rotate by putting a new key first and
// keeping the old ones until no value sealed with them is kept.
func NewAESGCM(keys []Key) (*aesGCM, error) {
	if len(keys) == 0 {
		return nil, errors.New("no key given; give at least one (the first seals, every one opens)")
	}
	c := &aesGCM{aeads: map[string]cipher.AEAD{}}
	for i, k := range keys {
		if !keyID.MatchString(k.ID) {
			return nil, fmt.Errorf("key %d: its ID %q is not 1 to 32 letters, digits, '_' or '-'", i+1, k.ID)
		}
		if _, dup := c.aeads[k.ID]; dup {
			return nil, fmt.Errorf("key %d: the ID %q is given twice; give each key its own ID", i+1, k.ID)
		}
		if len(k.Secret) != 32 {
			return nil, fmt.Errorf("key %q: the secret is %d bytes; AES-256 needs 32 (make one with `openssl rand -base64 32`)", k.ID, len(k.Secret))
		}
		block, err := aes.NewCipher(k.Secret)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", k.ID, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", k.ID, err)
		}
		c.ids = append(c.ids, k.ID)
		c.aeads[k.ID] = aead
	}
	return c, nil
}

// Seal returns format, the key's ID (length first), a random nonce and
// the ciphertext of plain, bound to the saga and the key's ID.
func (c *aesGCM) Seal(id uuid.UUID, plain []byte) ([]byte, error) {
	kid := c.ids[0]
	aead := c.aeads[kid]
	out := make([]byte, 0, 2+len(kid)+aead.NonceSize()+len(plain)+aead.Overhead())
	out = append(out, format, byte(len(kid)))
	out = append(out, kid...)
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	out = append(out, nonce...)
	return aead.Seal(out, nonce, plain, additional(id, kid)), nil
}

// Open returns what Seal sealed for the saga, with whichever key it names.
func (c *aesGCM) Open(id uuid.UUID, sealed []byte) ([]byte, error) {
	if len(sealed) < 2 || sealed[0] != format || len(sealed) < 2+int(sealed[1]) {
		return nil, errors.New("not a value this keyring sealed")
	}
	kid := string(sealed[2 : 2+int(sealed[1])])
	aead, ok := c.aeads[kid]
	if !ok {
		return nil, fmt.Errorf("it was sealed with key %q, which is not in the keyring (%s); add that key back", kid, strings.Join(c.ids, ", "))
	}
	rest := sealed[2+len(kid):]
	if len(rest) < aead.NonceSize()+aead.Overhead() {
		return nil, fmt.Errorf("the value sealed with key %q is cut short", kid)
	}
	plain, err := aead.Open(nil, rest[:aead.NonceSize()], rest[aead.NonceSize():], additional(id, kid))
	if err != nil {
		return nil, fmt.Errorf("the value sealed with key %q does not open for this saga (altered, or copied from another saga)", kid)
	}
	return plain, nil
}

func additional(id uuid.UUID, kid string) []byte {
	return append(id[:len(id):len(id)], kid...)
}

// ParseKeys reads a keyring: one key a line, its ID and its secret in
// standard base64, separated by spaces; '#' lines and blank lines are
// ignored. The first key seals. Errors name the line, never a secret.
func ParseKeys(text string) ([]Key, error) {
	var keys []Key
	for i, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) != 2 {
			return nil, fmt.Errorf("payload keys: line %d has %d fields; write <id> <base64 of 32 random bytes> (for example: k2026 $(openssl rand -base64 32))", i+1, len(f))
		}
		secret, err := base64.StdEncoding.DecodeString(f[1])
		if err != nil {
			return nil, fmt.Errorf("payload keys: line %d: the secret is not standard base64", i+1)
		}
		keys = append(keys, Key{ID: f[0], Secret: secret})
	}
	if len(keys) == 0 {
		return nil, errors.New("payload keys: no key found; write one key a line: <id> <base64 of 32 random bytes>")
	}
	if _, err := NewAESGCM(keys); err != nil {
		return nil, fmt.Errorf("payload keys: %w", err)
	}
	return keys, nil
}
