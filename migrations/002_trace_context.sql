-- The W3C trace context (traceparent, tracestate) of a saga's start, when
-- the engine that started it traces (engine.Config.TracerProvider): work
-- the engine does later on the saga's behalf without a message to carry
-- the context (a due retry, an expired lease taken over) continues the
-- saga's trace from it. NULL when the start was not traced; written once,
-- at the start, in the start's own statement.
alter table idemsaga.sagas add column trace_context jsonb;
