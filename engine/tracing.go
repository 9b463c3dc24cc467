package engine

import (
	"errors"

	"github.com/jackc/pgx/v5"
)

// selectTraceContext reads the trace context a saga's start recorded,
// NULL when it was not traced. It is queued only when the engine traces,
// beside the statements of the round trip that locks the saga.
const selectTraceContext = `select trace_context from idemsaga.sagas where id = $1`

// ignoreNoRows makes a row that is not there no error.
func ignoreNoRows(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	return err
}

// reapReason names why the reaper takes a step up, for its span.
func reapReason(due, expired, resend, waited bool) string {
	switch {
	case waited:
		return "wait expired"
	case resend:
		return "resend"
	case due:
		return "retry due"
	case expired:
		return "lease expired"
	}
	return ""
}
