package store

import "github.com/idemsaga/idemsaga/saga"

// SelectTraceContext reads the trace context a saga's start recorded,
// NULL when it was not traced. It is queued only when the engine traces,
// beside the statements of the round trip that locks the saga.
const SelectTraceContext = `select trace_context from idemsaga.sagas where id = $1`

// DeadlineArg is the deadline parameter of StartSaga: the definition's
// deadline in milliseconds, NULL for none.
func DeadlineArg(def *saga.Definition) any {
	if def.Deadline() <= 0 {
		return nil
	}
	return def.Deadline().Milliseconds()
}
