package store

// MarkCallbackLate marks a pending callback late ($4 says why): its step
// was given up before it came.
const MarkCallbackLate = `update idemsaga.callbacks set outcome = 'late', detail = $4 where definition = $1 and step = $2 and event_id = $3 and outcome = 'pending'`
