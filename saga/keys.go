package saga

import (
	"crypto/sha1"
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
