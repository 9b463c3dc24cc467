package saga

import (
	"crypto/sha1"
	"errors"
	"fmt"
	"strconv"

	"github.com/google/uuid"
)

// KeyNamespace is the UUIDv5 namespace under which step keys are derived.
// It never changes: changing it would give every in-flight step a new key
// and silently disable deduplication.
var KeyNamespace = uuid.MustParse("6b1f3c1e-2f0a-5d8e-9c4b-7a5e1d2c3b4a")

// StepKey returns the stable key of one step execution: UUIDv5 over the saga
// ID, the step name and the phase. It is identical across retries, workers
// and restarts, so handlers can pass it downstream (for example as an
// Idempotency-Key header) to make external effects deduplicate too.
func StepKey(sagaID uuid.UUID, step string, phase Phase) uuid.UUID {
	// uuid.NewSHA1(KeyNamespace, name), with name the saga ID's text, a
	// NUL byte, the step name, a NUL byte and the phase: the separator is
	// a byte no step name may contain, so distinct (step, phase) pairs
	// never produce the same name. Written out so that it allocates
	// nothing for usual names: the engine derives several keys per step.
	var buf [16 + 36 + 1 + 64 + 1 + 16]byte
	b := append(buf[:0], KeyNamespace[:]...)
	b = appendUUID(b, sagaID)
	b = append(b, 0)
	b = append(b, step...)
	b = append(b, 0)
	b = append(b, phase...)
	sum := sha1.Sum(b)
	var key uuid.UUID
	copy(key[:], sum[:])
	key[6] = (key[6] & 0x0f) | 0x50 // version 5
	key[8] = (key[8] & 0x3f) | 0x80 // RFC 4122 variant
	return key
}

// appendUUID appends id's canonical text (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx).
func appendUUID(b []byte, id uuid.UUID) []byte {
	const digits = "0123456789abcdef"
	for i, x := range id {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			b = append(b, '-')
		}
		b = append(b, digits[x>>4], digits[x&0x0f])
	}
	return b
}

// MessageID returns the broker message id of one attempt of a step: the
// step key plus the attempt number. A relay that publishes the same outbox
// row twice is absorbed by the broker's dedup window, while a deliberate
// retry (a new attempt) gets through.
func MessageID(stepKey uuid.UUID, attempt int) string {
	return stepKey.String() + "-" + strconv.Itoa(attempt)
}

// MaxKeyLength bounds a saga's idempotency key, in bytes.
const MaxKeyLength = 255

// ErrInvalidKey wraps every refusal of an idempotency key.
var ErrInvalidKey = errors.New("idemsaga: invalid idempotency key")

// CheckKey applies the one rule for saga idempotency keys, the same at
// every entry point (library, CLI, HTTP): 1 to MaxKeyLength characters
// of printable ASCII (space to '~'), neither starting nor ending with a
// space. Keys are compared byte for byte, so the rule refuses rather
// than trims or folds: "T-1" and " T-1" would otherwise be two intents
// that look like one. Printable ASCII is what an HTTP header carries
// without encoding, so every key can be replayed through any channel.
func CheckKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: it is empty; give the business identifier of this intent (such as a transfer request number)", ErrInvalidKey)
	case len(key) > MaxKeyLength:
		return fmt.Errorf("%w: it is %d bytes; keep it within %d", ErrInvalidKey, len(key), MaxKeyLength)
	case key[0] == ' ' || key[len(key)-1] == ' ':
		return fmt.Errorf("%w: %q starts or ends with a space; send it without the surrounding spaces", ErrInvalidKey, key)
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return fmt.Errorf("%w: byte %d of it is 0x%02x; use printable ASCII only (space to '~'), for example a UUID or a business number", ErrInvalidKey, i, key[i])
		}
	}
	return nil
}
