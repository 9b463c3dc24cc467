package saga

import (
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
	// The separator is a NUL byte, which no step name may contain, so
	// distinct (step, phase) pairs never produce the same name.
	name := make([]byte, 0, 36+1+len(step)+1+len(phase))
	name = append(name, sagaID.String()...)
	name = append(name, 0)
	name = append(name, step...)
	name = append(name, 0)
	name = append(name, phase...)
	return uuid.NewSHA1(KeyNamespace, name)
}

// MessageID returns the broker message id of one attempt of a step: the
// step key plus the attempt number. A relay that publishes the same outbox
// row twice is absorbed by the broker's dedup window, while a deliberate
// retry (a new attempt) gets through.
func MessageID(stepKey uuid.UUID, attempt int) string {
	return stepKey.String() + "-" + strconv.Itoa(attempt)
}
