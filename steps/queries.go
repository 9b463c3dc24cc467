package steps

const (
	idleTimeout = `select set_config('idle_in_transaction_session_timeout', $1, true)`

	// claimKey inserts the inbox row first, before any business write, so a
	// concurrent duplicate blocks on the unique key and then finds the
	// committed outcome; if this transaction rolls back, so does the row.
	// It returns 1 if it inserted the row, and leaves that in the
	// transaction for claimedOrRaise.
	claimKey = `with c as (
  insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome)
  values ($1, $2, $3, $4, $5, 'succeeded')
  on conflict (saga_id, step_key) do nothing
  returning 1
)
select set_config('idemsaga.claimed', count(*)::text, true)::int from c`

	// claimedOrRaise ends a claim that found the key taken: it raises
	// (idemsaga.expect, migration 004: IDM02) before the BEGIN
	// that would make the pipeline's implicit transaction the step's.
	claimedOrRaise = `select idemsaga.expect(current_setting('idemsaga.claimed') = '1', 'step key', 'claimed', 'claimed')`

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

	// readStored reads what the inbox holds for a key, after the claim in
	// the same pipeline: a claim that found the row waited for its writer
	// to commit, so this statement's snapshot sees what it committed.
	readStored = `select outcome, result, coalesce(error, ''), attempt from idemsaga.inbox where saga_id = $1 and step_key = $2`
)
