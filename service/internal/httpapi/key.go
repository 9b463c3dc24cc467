package httpapi

import (
	"net/http"
	"strings"

	"github.com/idemsaga/idemsaga/saga"
)

// Header names of the idempotency protocol.
const (
	// KeyHeader carries the client's idempotency key
	// (draft-ietf-httpapi-idempotency-key-header).
	KeyHeader = "Idempotency-Key"
	// ReplayedHeader is "true" on an answer for a request already handled
	// under the same key.
	ReplayedHeader = "Idempotent-Replayed"
)

// requestKey reads the Idempotency-Key of r: exactly one header, whose
// value is a structured-field String (RFC 8941: "…" with \" and \\
// escaped) or a bare value, unquoted and then held to saga.CheckKey.
func requestKey(r *http.Request) (string, *Problem) {
	values := r.Header.Values(KeyHeader)
	switch len(values) {
	case 0:
		return "", newProblem(http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
			"this request needs an Idempotency-Key header naming its business intent (an order number, a client-made UUID); send the same key when you retry, and a new one for a new intent")
	case 1:
	default:
		return "", invalidKey("send exactly one Idempotency-Key header")
	}
	key, ok := unquoteKey(values[0])
	if !ok {
		return "", invalidKey(`the Idempotency-Key starts with a double quote but is not a structured-field string; send "<key>" with only printable ASCII inside, escaping " and \ with \, or send the key bare`)
	}
	if err := saga.CheckKey(key); err != nil {
		return "", invalidKey(trimPrefix(err.Error()) + "; nothing was written")
	}
	return key, nil
}

func invalidKey(detail string) *Problem {
	return newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Invalid Idempotency-Key", detail)
}

// unquoteKey returns the key a header value names: a value that starts
// with a double quote is an sf-string (DQUOTE, printable ASCII with \"
// and \\ escaped, DQUOTE, nothing after); any other value is the key as
// sent. HTTP already stripped the whitespace around the field value.
func unquoteKey(v string) (string, bool) {
	if !strings.HasPrefix(v, `"`) {
		return v, true
	}
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", false
			}
			b.WriteByte(v[i])
		case c == '"':
			return b.String(), i == len(v)-1
		case c < 0x20 || c > 0x7e:
			return "", false
		default:
			b.WriteByte(c)
		}
	}
	return "", false // no closing quote
}

// trimPrefix drops the "idemsaga: " of the engine's messages, which reads
// oddly in an HTTP answer.
func trimPrefix(msg string) string { return strings.TrimPrefix(msg, "idemsaga: ") }
