package store

// The statements of submit tokens.

// InsertSubmitToken issues a token; $3 is its time to live in
// milliseconds.
const InsertSubmitToken = `insert into idemsaga.submit_tokens (token, definition, expires_at)
values ($1, $2, idemsaga.now() + $3 * interval '1 millisecond')
returning expires_at`

// StartSagaWithToken is StartSaga for a key that is a submit token
// ($3): it first consumes the token, if it was issued for the
// definition ($2), is unused and has not expired, and inserts the saga
// only then, in the same statement. A concurrent start of the token
// waits on the token's row; once the first commits, the row no longer
// matches (consumed), so it inserts nothing and adjudicates from the
// saga as a duplicate. A token that did not match and names no saga is
// invalid (explainSubmitToken).
var StartSagaWithToken = startWithToken(true)

// StartSagaWithTokenCarried is StartSagaWithToken as StartSagaCarried is
// StartSaga: no command.
var StartSagaWithTokenCarried = startWithToken(false)

func startWithToken(command bool) string {
	return `with ` + startLock + `, t as (
  update idemsaga.submit_tokens set saga_id = $1, consumed_at = idemsaga.now()
  where token = $3 and definition = $2 and consumed_at is null and expires_at > idemsaga.now() and (select got from l)
  returning token
), s as (
  insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state, deadline_at, definition_version, trace_context)
  select $1::uuid, $2::text, $3::text, $4::bytea, $5::jsonb, 'init', idemsaga.now() + $9::bigint * interval '1 millisecond', $10::int, $11::jsonb from t
  on conflict (definition, idem_key) do nothing
  returning id
)` + startRest(command)
}

// SelectSubmitToken reads why a token did not start a saga.
const SelectSubmitToken = `select definition, expires_at, consumed_at is not null, expires_at <= idemsaga.now()
from idemsaga.submit_tokens where token = $1`

// DeleteExpiredSubmitTokens deletes a batch of tokens past their
// expiry by more than $1 milliseconds. A consumed one goes too: its
// saga holds it as its key.
const DeleteExpiredSubmitTokens = `delete from idemsaga.submit_tokens where token in (
  select token from idemsaga.submit_tokens
  where expires_at < idemsaga.now() - $1 * interval '1 millisecond'
  order by expires_at
  limit $2
  for update skip locked)`
