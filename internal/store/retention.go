package store

// The statements of retention: finished sagas and published outbox rows
// deleted in batches.

// ClaimFinishedSagas locks a batch of finished sagas past the window.
// A saga with a step still in flight, or with a command or reply not
// yet published (a row the broker refused, say), is kept even if marked
// finished: that message may still be delivered. A child is kept while
// its parent is (saga.ChildStep): the parent may still compensate it.
const ClaimFinishedSagas = `select s.id from idemsaga.sagas s
where s.finished_at < idemsaga.now() - $1 * interval '1 millisecond'
  and (s.state not in ('failed', 'parked') or $3::bool)
  and not exists (
    select 1 from idemsaga.steps st
    where st.saga_id = s.id and st.status in ('dispatched', 'retrying', 'waiting'))
  and not exists (
    select 1 from idemsaga.outbox o
    where o.saga_id = s.id and o.published_at is null)
  and (s.parent_id is null or not exists (select 1 from idemsaga.sagas p where p.id = s.parent_id))
order by s.finished_at
limit $2
for update of s skip locked`

// The statements that read what an archive line holds beyond the saga's
// inspection (SelectSteps and the others), for a batch of sagas ($1)
// the cleaner claimed, in its transaction.
const (
	// SelectArchiveSagas reads the sagas' input hashes and trace
	// contexts, with the database clock's time of the read.
	SelectArchiveSagas = `select id, input_hash, trace_context, idemsaga.now() from idemsaga.sagas where id = any($1)`
	// SelectArchiveInbox reads the sagas' inbox rows, oldest first.
	SelectArchiveInbox = `select saga_id, step_key, step, phase::text, attempt, outcome::text, unknown, verified, result, coalesce(error, ''), created_at
from idemsaga.inbox where saga_id = any($1) order by saga_id, created_at, step_key`
)

// The statements that delete one batch of sagas ($1), in one transaction,
// children first (the foreign keys would cascade, one row at a time).
const (
	// DeleteSagaInbox deletes the sagas' inbox rows.
	DeleteSagaInbox = `delete from idemsaga.inbox where saga_id = any($1)`
	// DeleteSagaAttempts deletes the sagas' attempt timelines.
	DeleteSagaAttempts = `delete from idemsaga.step_attempts where saga_id = any($1)`
	// DeleteSagaSteps deletes the sagas' steps.
	DeleteSagaSteps = `delete from idemsaga.steps where saga_id = any($1)`
	// DeleteSagas deletes the sagas.
	DeleteSagas = `delete from idemsaga.sagas where id = any($1)`
)

// DeletePublishedOutbox deletes published rows past the window, in
// batches. Unpublished rows (published_at null) never match.
const DeletePublishedOutbox = `delete from idemsaga.outbox where id in (
  select id from idemsaga.outbox
  where published_at < idemsaga.now() - $1 * interval '1 millisecond'
  order by published_at
  limit $2
  for update skip locked)`
