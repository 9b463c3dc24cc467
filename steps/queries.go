package steps

const (
	// claimKey inserts the inbox row first, before any business write, so a
	// concurrent duplicate blocks on the unique key and then finds the
	// committed outcome; if this transaction rolls back, so does the row.
	// A key the inbox holds already raises (idemsaga.key_taken, migration
	// 010: IDM02) with the stored outcome, as storedColumns reads it, in
	// the error's DETAIL, before the BEGIN that would make the pipeline's
	// implicit transaction the step's. The DETAIL is empty when the
	// statement's snapshot cannot see that outcome: its writer committed
	// while the claim waited for it. It also bounds how long the
	// transaction may sit idle ($6): a stalled or stopped process must not
	// hold the key forever.
	claimKey = `with c as (
  insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
  values ($1, $2, $3, $4, $5, 'succeeded')
  on conflict (saga_id, step_key) do nothing
  returning 1
)
select case when (select count(*) from c) = 1 then 1
  else idemsaga.key_taken((select json_build_array(` + storedColumns + `)::text ` + storedFrom + `
    where i.saga_id = $2 and i.step_key = $1)) end,
  set_config('idle_in_transaction_session_timeout', $6, true)`

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
	readOutcome = `select i.outcome, coalesce(i.result, st.result), coalesce(i.error, '') ` + storedFrom + `
where i.saga_id = $1 and i.step_key = $2`

	// readStored reads what the inbox holds for a key: after a claim that
	// waited for the key's first writer, what that one committed.
	readStored = `select ` + storedColumns + ` ` + storedFrom + `
where i.saga_id = $1 and i.step_key = $2`

	// storedColumns and storedFrom read an inbox row's outcome, result,
	// error and attempt. A success applied to its saga in its own
	// transaction, as its command foresaw, left its result in the step's
	// row alone (applyAndCommit): the result is read from there when the
	// inbox row has none.
	storedColumns = `i.outcome, coalesce(i.result, st.result), coalesce(i.error, ''), i.attempt`
	storedFrom    = `from idemsaga.inbox i
left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
  and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'`
)
