package store

// The statements of the dead-letter table.

// DeadLetterColumns are a dead letter's columns, in the order the engine
// scans them.
const DeadLetterColumns = `id, saga_id, definition, definition_version, step, phase::text, attempt, subject, msg_id, reason, deliveries, parked_by, first_seen, last_seen`

// ResendDeadLetters deletes dead letters and writes their commands into
// the outbox, in one statement: by the steps a worker runs ($1,
// "name@version:step", NULL for any) and by id ($2, NULL for any), at most
// $3, skipping rows another process holds. The message id gets the dead
// letter's id as a suffix: the broker's dedup window must not drop the
// copy as a duplicate of the first. $4 is the rows' hand-off.
var ResendDeadLetters = `with d as (
  delete from idemsaga.dead_letters where id in (
    select id from idemsaga.dead_letters
    where ($1::text[] is null or definition || '@' || definition_version || ':' || step = any($1))
      and ($2::bigint[] is null or id = any($2))
    order by id limit $3 for update skip locked)
  returning id, subject, msg_id, payload, headers, saga_id
)
` + outboxInsert(`select subject, regexp_replace(msg_id, '-dl[0-9]+$', '') || '-dl' || id, payload, saga_id,
  clock_timestamp() + $4 * interval '1 millisecond', headers
from d`) + `
returning id, subject, msg_id, payload, headers`

// DropDeadLetters deletes dead letters by id ($1), returning those it deleted.
const DropDeadLetters = `delete from idemsaga.dead_letters where id = any($1) returning id`

// ListDeadLetters filters by saga ($1), definition ($2) and version ($3);
// NULL, empty or zero filters match all.
const ListDeadLetters = `select ` + DeadLetterColumns + ` from idemsaga.dead_letters
where ($1::uuid is null or saga_id = $1) and ($2 = '' or definition = $2) and ($3 = 0 or definition_version = $3)
order by id limit $4`
