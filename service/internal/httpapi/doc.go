// Package httpapi serves every saga definition of a deployment over HTTP,
// under /v1, honouring the Idempotency-Key request header of the IETF
// draft "The Idempotency-Key HTTP Header Field"
// (draft-ietf-httpapi-idempotency-key-header). The runtime's run command
// mounts it:
//
//	h, err := httpapi.New(httpapi.Config{Client: e.Client(), Tokens: tokens})
//	if err != nil { ... }
//	mux.Handle("/v1/", h)
//
// # Routes
//
//	POST /v1/sagas/{definition}       start a saga; the body is its input (Idempotency-Key required)
//	GET  /v1/sagas/{id}               the saga with its steps and attempts
//	GET  /v1/sagas?definition=&state=&limit=&cursor=
//	                                  sagas newest first, with counts by state
//	POST /v1/sagas/{id}/cancel        cancel it (Idempotency-Key required; body {"reason":…} optional)
//	POST /v1/sagas/{id}/retry         retry a failed or parked saga (likewise)
//	POST /v1/tokens                   issue a submit token; body {"definition":…,"ttl_seconds":…}
//	GET  /v1/definitions              the recorded definitions: steps, final state, every state
//	GET  /v1/stats                    this process's counters and backlog gauges (Stats)
//
// # The key
//
// The Idempotency-Key names one business intent. Its value is a
// structured-field String (RFC 8941: "T-1", with \" and \\ escaped) as the
// draft specifies, or the bare key: "T-1" and T-1 are the same key. The
// unquoted key then follows the rule of every entry point (library, CLI,
// HTTP; saga.CheckKey): 1 to 255 characters of printable ASCII, not
// starting or ending with a space. HTTP strips the whitespace around a
// bare value, so " T-1 " can only be sent quoted, and is refused. A key
// scopes to its definition (a start) or its saga (a repair).
//
// # Submit tokens
//
// Instead of a key of its own, a client may submit with a key the server
// issued: POST /v1/tokens with {"definition":"payout"} (and optionally
// "ttl_seconds", from 60 to Config.MaxSubmitTokenTTL; Config.SubmitTokenTTL
// by default) answers 201 with {"token":"st_…","definition":…,
// "expires_at":…,"ttl_seconds":…}. These are one-time saga keys, not the
// API's bearer tokens (Tokens). The start that carries one as its
// Idempotency-Key consumes it in the transaction that creates the saga;
// from then on it is that saga's key, with every answer above (a replay
// stays a replay after the token's expiry). A key that begins with st_ but
// was never issued, was issued for another definition, or expired unused
// is answered 400 with ProblemSubmitTokenInvalid: fetch a new token.
// Issuing takes no Idempotency-Key: a request sent again issues another
// token, and the unused one expires.
//
// # Answers of a start
//
//   - 201 Created: the saga was started. The body is
//     {"id":…,"definition":…,"key":…,"state":"init"}, Location is
//     /v1/sagas/{id}, and the saga runs on: read its progress with GET.
//   - 200 OK with Idempotent-Replayed: true: the key already names a saga
//     of this definition with the same input (compared by the SHA-256 of
//     its canonical JSON, so whitespace and member order do not matter),
//     started over HTTP or through another channel. The body is the one a
//     201 had or would have had, byte for byte: it is the answer as of the
//     saga's creation, never its current state.
//   - 400: the key is missing, sent twice or refused, or is a submit
//     token that cannot be used (never issued, another definition's,
//     expired: ProblemSubmitTokenInvalid); or the input is
//     refused (invalid JSON, a member twice or in two spellings, a member
//     the definition's input type lacks, its validator's refusal: the
//     detail says which).
//   - 404: no definition has the name.
//   - 409 with Retry-After: 1: another request with this key and
//     definition is being handled at this moment. Retry it to get its
//     answer.
//   - 413: the body exceeds Config.MaxBodyBytes (256 KiB by default).
//   - 415: the Content-Type is not application/json (UTF-8).
//   - 422: the key already names a saga of this definition with another
//     input.
//   - 503: this server's settings differ from the deployment's; it writes
//     nothing until its operator fixes them.
//   - 500: the server failed; retrying with the same key is safe.
//
// # Answers of a cancel or retry
//
// 200 with {"id","operation","state","key","at"}: the repair as it
// committed; the same request sent again with its key answers the same
// bytes with Idempotent-Replayed: true and does nothing. 400 for a bad
// key, ID or body; 404 for no such saga; 409 when the saga's state does
// not allow it (the detail says the state and what is allowed); 422 when
// the key names another request on the saga (another operation or
// reason).
//
// # Reads
//
// GET /v1/sagas/{id} answers 400 for an ID that is not a UUID and 404 for
// no such saga. GET /v1/sagas takes limit from 1 to 500 (50 by default)
// and answers {"sagas":[…],"next_cursor":…,"counts":{state:n}};
// next_cursor is null on a short page, and a cursor this API did not
// answer with is a 400. Entries leave out input, results and steps.
//
// GET /v1/stats reads Config.Gatherer when asked (501 without one): the
// counters are cumulative for this process and restart with it, so a
// client computes rates from two answers and their "at"; a gauge that
// could not be read (the broker out of reach) is null.
//
// Every error answer, including an unknown path (404) and a wrong method
// (405, with Allow), is application/problem+json (RFC 9457) with type,
// title, status and detail; the type is one of the Problem* constants.
// With Config.Tokens, a request without one of them gets 401 with
// WWW-Authenticate: Bearer before anything of it is read; a token whose
// Scope is below the route's, or that does not cover the saga's
// definition, gets 403 and nothing is done. Repairs are recorded as by
// "http:" and the token's name.
//
// # Guarantees
//
//   - A refused request writes nothing: the key, media type, size,
//     definition and input are checked before any transaction, and the
//     start's transaction commits only a saga the engine accepted.
//   - One saga per key: the engine's unique (definition, key) decides, in
//     the start's transaction, however many requests, processes and
//     channels race.
//   - A replay is byte-identical: the body is computed from the saga's ID,
//     definition and key only.
//   - 409 only while another request holds the key: a start takes
//     pg_try_advisory_xact_lock on a 64-bit hash of definition and key,
//     without waiting, in the statement that inserts the saga. The lock
//     lives exactly as long as that transaction: the statement alone (or,
//     for a saga that starts with a parallel group, the transaction that
//     also dispatches the group's branches), or, when this process runs
//     the saga's first step and it is a database step, that step's first
//     attempt too, which commits with the saga
//     (no message crosses the broker), bounded by the step's timeout. If
//     its process dies, PostgreSQL ends the transaction and
//     releases the lock at once, so no claim is ever left behind and no
//     table of claims needs cleaning. A start whose answer was lost (a
//     crash after the commit) is answered by its retry with 200.
//   - A write runs to its end or rolls back whether or not the client waits
//     for its answer; neither logs nor answers carry the Authorization
//     header or a token.
//
// The handler does not wake the engine's outbox relay: a saga's first
// command is published at the relay's next poll.
package httpapi
