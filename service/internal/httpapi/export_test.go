package httpapi

import "github.com/idemsaga/idemsaga/internal/startlock"

// LockKey is the advisory lock a start holds on (definition, key), for
// tests that hold it themselves.
var LockKey = startlock.ID

// UnquoteKey exposes the Idempotency-Key unquoting to the fuzz test.
var UnquoteKey = unquoteKey

// Patterns lists every route's pattern, for the router's fuzz test.
func Patterns() []string {
	var out []string
	for _, rt := range (&api{}).routes() {
		out = append(out, rt.pattern)
	}
	return out
}
