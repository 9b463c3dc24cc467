package httpapi

// LockKey is the advisory lock a start holds on (definition, key), for
// tests that hold it themselves.
var LockKey = lockKey

// UnquoteKey exposes the Idempotency-Key unquoting to the fuzz test.
var UnquoteKey = unquoteKey
