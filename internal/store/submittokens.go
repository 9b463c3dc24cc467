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
var StartSagaWithToken = StartStatement(true, false, true)

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
