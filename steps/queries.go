package steps

const (
	// claimKey inserts the inbox row first, before any business write, so a
	// concurrent duplicate blocks on the unique key and then finds the
	// committed outcome; if this transaction rolls back, so does the row.
	// A key the inbox holds already raises (idemsaga.expect, migration 004:
	// IDM02), before the BEGIN that would make the pipeline's implicit
	// transaction the step's. It also bounds how long the transaction may
	// sit idle ($6): a stalled or stopped process must not hold the key
	// forever.
	claimKey = `with c as (
  insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
  values ($1, $2, $3, $4, $5, 'succeeded')
  on conflict (saga_id, step_key) do nothing
  returning 1
)
select idemsaga.expect(count(*) = 1, 'step key', 'claimed', 'claimed'),
  set_config('idle_in_transaction_session_timeout', $6, true)
from c`

	recordResult = `update idemsaga.inbox set result = $3 where saga_id = $1 and step_key = $2`

	recordFailure = `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome, error)
values ($1, $2, $3, $4, $5, 'failed', $6)
on conflict (saga_id, step_key) do nothing`

	// tombstone fences a forward step before its compensation: if the
	// forward command has not run yet, it never will.
	tombstone = `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
values ($1, $2, $3, 'forward', 0, 'tombstone')
on conflict (saga_id, step_key) do nothing`

	readOutcome = `select outcome, result, coalesce(error, '') from idemsaga.inbox where saga_id = $1 and step_key = $2`

	// readStored reads what the inbox holds for a key. Before the claim in
	// its pipeline it finds an outcome committed before the delivery (the
	// common duplicate); one whose writer the claim waited for is read
	// again after it.
	readStored = `select outcome, result, coalesce(error, ''), attempt from idemsaga.inbox where saga_id = $1 and step_key = $2`
)
