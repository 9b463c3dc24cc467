package httpapi

// SQL of the idempotency records (table idemsaga.http_idempotency, created
// by migrations/002_http_idempotency.sql). Durations travel as microseconds
// so they are computed on the database clock.
const (
	// claimKey claims a key no row holds. A concurrent claim of the same
	// key waits on the unique index until this one commits, then inserts
	// nothing.
	claimKey = `insert into idemsaga.http_idempotency (key, request_hash, token, expires_at)
values ($1, $2, $3, idemsaga.now() + $4::bigint * interval '1 microsecond')
on conflict (key) do nothing`

	// readKey reads the row holding a key, with its staleness and expiry
	// judged by the database clock.
	readKey = `select request_hash, token, status, body, coalesce(content_type, ''), coalesce(location, ''),
  completed_at is not null,
  claimed_at <= idemsaga.now() - $2::bigint * interval '1 microsecond',
  expires_at <= idemsaga.now()
from idemsaga.http_idempotency where key = $1`

	// takeOverKey replaces an expired row, or an abandoned claim (stale,
	// never completed), with a new claim. It is conditional on the token
	// read and re-checks the condition, so a request that completes or is
	// taken over meanwhile is never overwritten.
	takeOverKey = `update idemsaga.http_idempotency set
  request_hash = $3, token = $4, status = null, body = null, content_type = null, location = null,
  created_at = idemsaga.now(), claimed_at = idemsaga.now(), completed_at = null,
  expires_at = idemsaga.now() + $5::bigint * interval '1 microsecond'
where key = $1 and token = $2
  and (expires_at <= idemsaga.now() or (completed_at is null and claimed_at <= idemsaga.now() - $6::bigint * interval '1 microsecond'))`

	// completeKey records the answer of the claim holding token. It runs
	// in the transaction that starts the saga.
	completeKey = `update idemsaga.http_idempotency set
  status = $3, body = $4, content_type = $5, location = $6, completed_at = idemsaga.now(),
  expires_at = idemsaga.now() + $7::bigint * interval '1 microsecond'
where key = $1 and token = $2 and completed_at is null`

	// releaseKey drops an unanswered claim, so that a retry after a
	// failure is handled at once instead of after the claim goes stale.
	releaseKey = `delete from idemsaga.http_idempotency where key = $1 and token = $2 and completed_at is null`
)
