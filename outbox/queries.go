package outbox

const (
	insertOne = `insert into idemsaga.outbox (subject, msg_id, payload, headers, saga_id) values ($1, $2, $3, $4, $5)`

	insertMany = `insert into idemsaga.outbox (subject, msg_id, payload, headers, saga_id)
select * from unnest($1::text[], $2::text[], $3::bytea[], $4::jsonb[], $5::uuid[])`

	// claimBatch takes unpublished rows by state, skipping rows another
	// relay holds and rows their writer is still publishing itself. Never
	// "id > last seen": ids commit out of order. The hand-off is wall
	// time, as it was written (clock_timestamp), not the engine's clock,
	// which the test kit moves forward.
	claimBatch = `select id, subject, msg_id, payload, headers
from idemsaga.outbox
where published_at is null and (publish_after is null or publish_after <= statement_timestamp())
order by id
limit $1
for update skip locked`

	// anyDue is the relay's look before it claims: whether claimBatch
	// would find a row, without a transaction or locks. Rows another relay
	// holds count, so the claim may still find none.
	anyDue = `select exists (select 1 from idemsaga.outbox
where published_at is null and (publish_after is null or publish_after <= statement_timestamp()))`

	markPublished = `update idemsaga.outbox set published_at = idemsaga.now() where id = any($1)`

	deletePublished = `delete from idemsaga.outbox where id = any($1)`

	// settleDelete deletes rows acknowledged after Publish, skipping rows
	// a sweep holds (it deletes those itself once it published them), so
	// the settle loop never waits on a sweep's broker round trip.
	settleDelete = `delete from idemsaga.outbox where id in (
  select id from idemsaga.outbox where id = any($1) for update skip locked)`

	// settleMark is settleDelete for KeepPublished.
	settleMark = `update idemsaga.outbox set published_at = idemsaga.now() where id in (
  select id from idemsaga.outbox where id = any($1) and published_at is null for update skip locked)`

	markFailed = `update idemsaga.outbox set attempts = attempts + 1, last_error = $2 where id = $1`

	backlog = `select count(*), coalesce(extract(epoch from idemsaga.now() - min(created_at)), 0)
from idemsaga.outbox where published_at is null`
)
