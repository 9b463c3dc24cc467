package store

// SelectTraceContext reads the trace context a saga's start recorded,
// NULL when it was not traced. It is queued only when the engine traces,
// beside the statements of the round trip that locks the saga.
const SelectTraceContext = `select trace_context from idemsaga.sagas where id = $1`
