package steps

const (
	// claimKey inserts the inbox row first, before any business write, so a
	// concurrent duplicate blocks on the unique key and then finds the
	// committed outcome; if this transaction rolls back, so does the row.
	// A key the inbox holds already raises (idemsaga.key_held, migration
	// 012: IDM02) with the stored outcome, before the
	// BEGIN that would make the pipeline's implicit transaction the step's:
	// the conflict's update is only there to call it, with the columns of
	// the row it met (locked, in its latest committed version), so that
	// the raise need not look that row up again. The inserted row
	// returns the bound on how long the transaction may sit idle ($6): a
	// stalled or stopped process must not hold the key forever. One plain
	// INSERT, so that PostgreSQL starts as few executor nodes as it can.
	claimKey = claimKeyInOneTrip + `
returning set_config('idle_in_transaction_session_timeout', $6, true)`

	// claimKeyInOneTrip is claimKey for a transaction that is the claim's
	// own batch, committed at its Sync (claim.inOneTrip): PostgreSQL arms
	// the idle bound only when it answers a Sync inside a transaction, so
	// the bound has nothing to guard there. Without it the statement
	// returns no row, which PostgreSQL runs as a plain INSERT rather than
	// through a portal that stores its rows: about 25,000 instructions
	// less per step (measured under callgrind).
	claimKeyInOneTrip = `insert into idemsaga.inbox as i (step_key, saga_id, step, phase, attempt, outcome)
values ($1, $2, $3, $4, $5, 'succeeded')
on conflict (saga_id, step_key) do update
set attempt = idemsaga.key_held(i.saga_id, i.step, i.phase, i.outcome, i.result, i.error, i.attempt)`

	recordResult = `update idemsaga.inbox set result = $3 where saga_id = $1 and step_key = $2`

	recordFailure = `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome, error)
values ($1, $2, $3, $4, $5, 'failed', $6)
on conflict (saga_id, step_key) do nothing`

	// tombstone fences a forward step before its compensation: if the
	// forward command has not run yet, it never will.
	tombstone = `insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
values ($1, $2, $3, 'forward', 0, 'tombstone')
on conflict (saga_id, step_key) do nothing`

	// readStored reads what the inbox holds for a key: a duplicate's
	// answer, or a forward step's outcome for its compensation.
	readStored = `select i.outcome, coalesce(i.result, st.result), coalesce(i.error, ''), i.attempt ` + storedFrom + `
where i.saga_id = $1 and i.step_key = $2`

	// storedFrom reads an inbox row, with the step's row for its result
	// (see idemsaga.key_held, migration 012).
	storedFrom = `from idemsaga.inbox i
left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
  and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'`
)
