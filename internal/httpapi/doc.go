// Package httpapi serves idemsaga's transfer saga over HTTP, honouring the
// Idempotency-Key request header of the IETF draft "The Idempotency-Key
// HTTP Header Field" (draft-ietf-httpapi-idempotency-key-header).
//
//	h, err := httpapi.New(httpapi.Config{Pool: pool, Client: e.Client(), Definition: transfer.Definition})
//	if err != nil { ... }
//	mux.Handle("/transfers", h)
//	mux.Handle("/transfers/", h)
//
// Routes:
//
//	POST /transfers       body {"from":1,"to":2,"amount":100}, header Idempotency-Key
//	GET  /transfers/{id}  the saga: state, input, results, error, times, and
//	                      its step executions as a timeline
//
// # Answers of POST /transfers
//
//   - 201 Created: the saga was started. The body is
//     {"id":…,"key":…,"state":"init","duplicate":false} and Location is
//     /transfers/{id}. The saga runs on; read its progress with GET.
//   - 200 OK: the key already named a saga with this input, started through
//     another channel (the CLI, say) or before the stored answer expired:
//     the same body with that saga's id and "duplicate":true.
//   - A replay (the same key and body as a request already answered):
//     exactly the first answer's status and body, byte for byte, with the
//     header Idempotent-Replayed: true. Its "state" is the state at the
//     first answer, not the current one.
//   - 400: the Idempotency-Key is missing, empty, longer than 255 bytes,
//     sent twice or not printable ASCII; or the body is not one JSON object
//     with exactly the integer fields from, to and amount; or the amount is
//     not positive, or from equals to.
//   - 409 with Retry-After: a request with the same key and body is still
//     being handled. Retry it to get its answer.
//   - 413: the body exceeds Config.MaxBodyBytes (16 KiB by default).
//   - 415: the Content-Type is not application/json (UTF-8).
//   - 422: the key was first used with a different body (compared by the
//     SHA-256 of the canonical JSON, so whitespace and field order do not
//     matter), or already names a saga with a different input.
//   - 500: the server failed; retrying with the same key is safe.
//
// Every error answer is application/problem+json (RFC 9457) with type,
// title, status and detail; the type is one of the Problem* constants.
// The key is checked first, then the media type, then the body.
//
// # Guarantees
//
//   - A refused request writes nothing: every check runs before the key is
//     claimed, and a failure after the claim gives the claim back.
//   - The database adjudicates, not this code. A request claims its key
//     with INSERT … ON CONFLICT DO NOTHING in idemsaga.http_idempotency;
//     when a row is there, its stored hash, completion and age decide
//     between replay, 422 and 409. Concurrent requests with one key start
//     one saga, and each of them gets either its answer or a 409.
//   - The saga start (engine.Client.StartTx) and the stored answer commit
//     in one transaction, so a crash cannot leave a saga without its
//     answer or an answer without its saga. The claim commits before them,
//     on its own, so that concurrent requests see it and get 409 instead
//     of waiting.
//   - A claim left unanswered for Config.ClaimTimeout (a crashed process)
//     is taken over by the next request with the same key and body; the
//     takeover gives the claim a new token, and the answer of the request
//     that lost it is refused, which rolls back its saga start too.
//   - The saga's key is the Idempotency-Key, so the engine's own unique
//     (definition, key) backs the HTTP layer: after a stored answer expires
//     (Config.KeyTTL, 7 days by default), the same key and body get the
//     same saga (200, duplicate), and a different body a 422.
//
// Stored answers past their expiry stay in the table until their key is
// used again: no cleaner deletes them yet. One that does must delete only
// rows whose expires_at has passed, in small batches (index
// http_idempotency_expires_idx).
//
// The handler does not wake the engine's outbox relay: a started saga's
// first command is published at the relay's next poll (100ms by default).
package httpapi
