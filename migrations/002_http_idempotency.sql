-- Why: the HTTP API (internal/httpapi) honours the Idempotency-Key request
-- header (draft-ietf-httpapi-idempotency-key-header): a retried POST must
-- get the first answer back byte for byte, a concurrent one a 409, and a
-- key reused with another body a 422. The adjudication lives here, not in
-- application code: a request claims its key with INSERT ... ON CONFLICT DO
-- NOTHING, and every later change is a conditional update fenced by the
-- claim's token. The response is recorded in the same transaction that
-- starts the saga, so one never commits without the other.

create table idemsaga.http_idempotency (
    -- The Idempotency-Key header's value; also the saga's key.
    key          text primary key check (length(key) between 1 and 255),
    -- SHA-256 of the request's canonical JSON: the same key with another
    -- body is refused (422), whitespace and key order do not matter.
    request_hash bytea not null,
    -- Fencing token of the current claim. A stale claim taken over gets a
    -- new token, so the request that lost it cannot record its answer.
    token        uuid not null,
    -- The stored answer, null while the request is in flight.
    status       int,
    body         bytea,
    content_type text,
    location     text,
    created_at   timestamptz not null default now(),
    claimed_at   timestamptz not null default now(),
    completed_at timestamptz,
    -- After this the key may be claimed anew (the saga's own unique key
    -- still deduplicates). No cleaner deletes rows yet; a future one must
    -- delete only rows past expires_at, in small batches.
    expires_at   timestamptz not null,
    constraint http_idempotency_answer_complete check (
        (completed_at is null and status is null and body is null)
        or (completed_at is not null and status is not null and body is not null))
);

-- For the future cleaner: rows whose stored answer has expired.
create index http_idempotency_expires_idx on idemsaga.http_idempotency (expires_at);
