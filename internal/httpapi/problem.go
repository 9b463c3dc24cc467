package httpapi

import (
	"encoding/json"
	"net/http"
)

// ProblemContentType is the media type of every error answer (RFC 9457).
const ProblemContentType = "application/problem+json"

// Problem types: the "type" member of every error answer. Clients should
// branch on these, not on the title or detail, which are for people.
const (
	// ProblemKeyMissing: POST /transfers came without an Idempotency-Key
	// header (400).
	ProblemKeyMissing = "urn:idemsaga:problem:idempotency-key-missing"
	// ProblemKeyInvalid: the Idempotency-Key header is empty, longer than
	// 255 bytes, sent more than once or not a printable ASCII string (400).
	ProblemKeyInvalid = "urn:idemsaga:problem:idempotency-key-invalid"
	// ProblemKeyReused: the key was already used with a different request
	// body, over HTTP or through another channel such as the CLI (422).
	ProblemKeyReused = "urn:idemsaga:problem:idempotency-key-reused"
	// ProblemInFlight: a request with the same key is still being handled;
	// retry after the Retry-After delay to get its answer (409).
	ProblemInFlight = "urn:idemsaga:problem:request-in-flight"
	// ProblemUnsupportedMediaType: the body is not application/json (415).
	ProblemUnsupportedMediaType = "urn:idemsaga:problem:unsupported-media-type"
	// ProblemBodyTooLarge: the body exceeds Config.MaxBodyBytes (413).
	ProblemBodyTooLarge = "urn:idemsaga:problem:body-too-large"
	// ProblemMalformedBody: the body is not one JSON object of the expected
	// shape: bad syntax, a wrong type, an unknown or missing field (400).
	ProblemMalformedBody = "urn:idemsaga:problem:malformed-body"
	// ProblemInvalidTransfer: the transfer can never succeed: a zero or
	// negative amount, or the same source and destination (400).
	ProblemInvalidTransfer = "urn:idemsaga:problem:invalid-transfer"
	// ProblemInvalidID: the saga ID in the path is not a UUID (400).
	ProblemInvalidID = "urn:idemsaga:problem:invalid-id"
	// ProblemNotFound: no transfer has the ID in the path (404).
	ProblemNotFound = "urn:idemsaga:problem:not-found"
	// ProblemInternal: the server failed, for example because the
	// database is unreachable (500). Retrying with the same
	// Idempotency-Key is safe: it gets the first answer if one was
	// recorded, and is handled anew otherwise.
	ProblemInternal = "urn:idemsaga:problem:internal"
)

// Problem is an error answer in the format of RFC 9457 ("Problem Details
// for HTTP APIs").
type Problem struct {
	// Type identifies the kind of problem: one of the Problem* constants.
	Type string `json:"type"`
	// Title is a short summary of the kind of problem.
	Title string `json:"title"`
	// Status repeats the HTTP status code.
	Status int `json:"status"`
	// Detail explains this occurrence and what to do next.
	Detail string `json:"detail"`
}

func newProblem(status int, typ, title, detail string) *Problem {
	return &Problem{Type: typ, Title: title, Status: status, Detail: detail}
}

// writeProblem writes p as the answer.
func writeProblem(w http.ResponseWriter, p *Problem) {
	body, err := json.Marshal(p)
	if err != nil { // cannot happen: Problem holds strings and an int
		http.Error(w, p.Detail, p.Status)
		return
	}
	h := w.Header()
	h.Set("Content-Type", ProblemContentType)
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(p.Status)
	_, _ = w.Write(append(body, '\n'))
}
