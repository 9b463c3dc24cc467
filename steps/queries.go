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

	// readOutcome reads a forward step's outcome, for its compensation;
	// the result as readStored.
	readOutcome = `select i.outcome, coalesce(i.result, st.result), coalesce(i.error, '')
from idemsaga.inbox i
left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
  and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'
where i.saga_id = $1 and i.step_key = $2`

	// readStored reads what the inbox holds for a key. Before the claim in
	// its pipeline it finds an outcome committed before the delivery (the
	// common duplicate); one whose writer the claim waited for is read
	// again after it.
	//
	// A success applied to its saga in its own transaction, as its command
	// foresaw, left its result in the step's row alone (applyAndCommit):
	// the result is read from there when the inbox row has none.
	readStored = `select i.outcome, coalesce(i.result, st.result), coalesce(i.error, ''), i.attempt
from idemsaga.inbox i
left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
  and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'
where i.saga_id = $1 and i.step_key = $2`
)
