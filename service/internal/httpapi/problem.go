package httpapi

import (
	"encoding/json"
	"net/http"
	"strings"
)

// ProblemContentType is the media type of every error answer (RFC 9457).
const ProblemContentType = "application/problem+json"

// Problem types: the "type" member of every error answer. Clients branch
// on these, not on the title or detail, which are for people.
const (
	// ProblemKeyMissing: a write came without an Idempotency-Key (400).
	ProblemKeyMissing = "urn:idemsaga:problem:idempotency-key-missing"
	// ProblemKeyInvalid: the Idempotency-Key was sent twice, is not a
	// valid structured-field string, or breaks the key rule (400).
	ProblemKeyInvalid = "urn:idemsaga:problem:idempotency-key-invalid"
	// ProblemKeyReused: the key already names a saga of this definition
	// with another input, or a repair of this saga with another operation
	// or reason (422).
	ProblemKeyReused = "urn:idemsaga:problem:idempotency-key-reused"
	// ProblemInFlight: another request with the same key is being handled
	// right now; retry after Retry-After to get its answer (409).
	ProblemInFlight = "urn:idemsaga:problem:request-in-flight"
	// ProblemUnsupportedMediaType: the body is not application/json (415).
	ProblemUnsupportedMediaType = "urn:idemsaga:problem:unsupported-media-type"
	// ProblemBodyTooLarge: the body exceeds Config.MaxBodyBytes (413).
	ProblemBodyTooLarge = "urn:idemsaga:problem:body-too-large"
	// ProblemInvalidInput: the saga input was refused: not valid JSON, a
	// member twice or in two spellings, a member the input type lacks, or
	// the definition's validator said no (400).
	ProblemInvalidInput = "urn:idemsaga:problem:invalid-input"
	// ProblemMalformedRequest: a query parameter, a repair body or the
	// saga ID in the path is not what the route takes (400).
	ProblemMalformedRequest = "urn:idemsaga:problem:malformed-request"
	// ProblemUnknownDefinition: no saga definition has the name in the
	// path (404).
	ProblemUnknownDefinition = "urn:idemsaga:problem:unknown-definition"
	// ProblemNotFound: no saga has the ID in the path, or no route has
	// the path (404).
	ProblemNotFound = "urn:idemsaga:problem:not-found"
	// ProblemMethodNotAllowed: the path takes other methods, listed in the
	// Allow header (405).
	ProblemMethodNotAllowed = "urn:idemsaga:problem:method-not-allowed"
	// ProblemStateForbids: the saga's state does not allow the repair; the
	// detail says the state and what is allowed (409).
	ProblemStateForbids = "urn:idemsaga:problem:state-forbids"
	// ProblemUnauthorized: no bearer token, or not one of the configured
	// tokens (401).
	ProblemUnauthorized = "urn:idemsaga:problem:unauthorized"
	// ProblemForbidden: the bearer token's scope does not allow the
	// route, or the token does not cover the saga's definition (403).
	ProblemForbidden = "urn:idemsaga:problem:forbidden"
	// ProblemMisconfigured: this server's settings or definitions differ
	// from the deployment's, so it refuses to write (503).
	ProblemMisconfigured = "urn:idemsaga:problem:server-misconfigured"
	// ProblemSubmitTokenInvalid: the Idempotency-Key is a submit token
	// (prefix st_) that was never issued, was issued for another
	// definition, or expired unused; POST /v1/tokens issues a new one
	// (400).
	ProblemSubmitTokenInvalid = "urn:idemsaga:problem:submit-token-invalid"
	// ProblemOverloaded: the engine's queue is behind (its stream's backlog
	// is above the shedding threshold), so the start was refused and
	// nothing written; retry the same request after Retry-After (503).
	ProblemOverloaded = "urn:idemsaga:problem:overloaded"
	// ProblemInternal: the server failed, for example because the database
	// is unreachable (500). Retrying with the same Idempotency-Key is safe.
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

// WriteProblem answers with status and an application/problem+json body,
// for the runtime's own routes (a /metrics 401, say) to answer like the API.
func WriteProblem(w http.ResponseWriter, status int, typ, title, detail string) {
	writeProblem(w, newProblem(status, typ, title, detail))
}

// newProblem returns a problem whose detail does not say its title again:
// an error's text that starts with it (a sentinel the engine wrapped) is
// cut after the title.
func newProblem(status int, typ, title, detail string) *Problem {
	if len(detail) > len(title)+2 && strings.EqualFold(detail[:len(title)], title) && detail[len(title):len(title)+2] == ": " {
		detail = detail[len(title)+2:]
	}
	return &Problem{Type: typ, Title: title, Status: status, Detail: detail}
}

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
