package main

// The prefill of `worker bench --prefill`: finished sagas written by SQL in
// the shape the engine leaves them, so that start and step latency can be
// measured against tables that hold millions.

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/examples/transfer"
)

// reusePrefilled opens --db-name when --reuse-prefill is set and it holds
// exactly --prefill prefilled sagas, and brings it back to the state the
// prefill left: the earlier run's sagas (with their steps, inbox rows,
// attempts and ledger rows) and outbox rows deleted, the accounts at their
// seeded balances (the prefill's ledger nets zero on account 1), vacuumed.
func reusePrefilled(ctx context.Context, g *globals, b *benchCmd, accounts int) (dsn string, pool *pgxpool.Pool, seeded int64, ok bool, err error) {
	if !b.ReusePrefill {
		return "", nil, 0, false, nil
	}
	if dsn, err = withDBName(g.DatabaseURL, b.DBName); err != nil {
		return "", nil, 0, false, err
	}
	if pool, err = openDB(ctx, dsn, 4); err != nil {
		fmt.Printf("bench: --reuse-prefill: no database %s to reuse (%v); prefilling one\n", b.DBName, err)
		return "", nil, 0, false, nil
	}
	var n int
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where idem_key like 'prefill-%'`).Scan(&n); err != nil || n != b.Prefill {
		pool.Close()
		fmt.Printf("bench: --reuse-prefill: %s holds %d prefilled sagas, not %d (%v); prefilling afresh\n", b.DBName, n, b.Prefill, err)
		return "", nil, 0, false, nil
	}
	start := time.Now()
	for _, q := range []string{
		`delete from transfer.ledger where created_at > now() - interval '12 hours'`,
		`delete from idemsaga.sagas where idem_key not like 'prefill-%'`,
		`delete from idemsaga.outbox`,
		`update transfer.accounts set balance = 1000000000`,
		`vacuum analyze idemsaga.sagas, idemsaga.steps, idemsaga.step_attempts, idemsaga.inbox, idemsaga.outbox, transfer.ledger, transfer.accounts`,
		`checkpoint`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			pool.Close()
			return "", nil, 0, false, fmt.Errorf("--reuse-prefill: %s: %w", q, err)
		}
	}
	seeded, found, err := transfer.Seeded(ctx, pool)
	if err != nil || !found {
		pool.Close()
		return "", nil, 0, false, fmt.Errorf("--reuse-prefill: %s has no seed recorded (%v): drop it", b.DBName, err)
	}
	if seeded != int64(accounts+1)*1_000_000_000 {
		pool.Close()
		return "", nil, 0, false, fmt.Errorf("--reuse-prefill: %s was seeded with %d, not by this benchmark: drop it", b.DBName, seeded)
	}
	syscall.Sync()
	fmt.Printf("bench: reused %d prefilled sagas in %s, the earlier run's deleted in %s\n", n, b.DBName, time.Since(start).Round(time.Second))
	return dsn, pool, seeded, true, nil
}

// prefill writes n finished transfer sagas as the engine leaves them, in
// the mix of a bench run: 95% credited (saga, two succeeded steps and
// their inbox rows, two ledger rows that cancel out on account 1), every
// 20th compensated (its credit failed, its deduct compensated: three steps
// and inbox rows, a deduct and a refund), and every 100th credited after
// one retry of its credit (attempt 2 and a step_attempts row); no outbox
// rows, which the relay deletes once published. Their keys are numbered
// with zeros in front, so that each batch goes to the right edge of the
// key index, as the ids do. It writes them in batches, then vacuums, analyzes and
// checkpoints, so that a run measures the engine on large tables. Their
// ids are UUIDv7 from a day before, one millisecond apart, as the engine
// would have made them: older than every id of the run, so the run's
// sagas, steps and inbox rows go to the right edge of their indexes as in
// a deployment that has run for a while. (Random ids, as before, put them
// into one leaf in the middle of each index, split again and again.)
func prefill(ctx context.Context, pool *pgxpool.Pool, n int) error {
	const batch = 50_000
	start := time.Now()
	for lo := 1; lo <= n; lo += batch {
		hi := min(n, lo+batch-1)
		if _, err := pool.Exec(ctx, prefillSQL, lo, hi); err != nil {
			return fmt.Errorf("prefill sagas %d to %d: %w", lo, hi, err)
		}
	}
	for _, t := range []string{"idemsaga.sagas", "idemsaga.steps", "idemsaga.step_attempts", "idemsaga.inbox", "transfer.ledger"} {
		if _, err := pool.Exec(ctx, "vacuum analyze "+t); err != nil {
			return fmt.Errorf("prefill: vacuum %s: %w", t, err)
		}
	}
	// Write the prefill's dirty pages out now, so that the checkpoint it
	// would trigger does not land in the measured run.
	if _, err := pool.Exec(ctx, "checkpoint"); err != nil {
		fmt.Printf("bench: prefill: checkpoint not run (%v); the measured run may include it\n", err)
	}
	// And have the kernel write back what the prefill left dirty in the
	// page cache (a gigabyte of WAL and tables for a million sagas): its
	// writeback would otherwise stall the measured run's WAL flushes.
	syscall.Sync()
	fmt.Printf("bench: prefilled %d finished sagas in %s\n", n, time.Since(start).Round(time.Second))
	return nil
}

const prefillSQL = `with s as (
  insert into idemsaga.sagas (id, definition, idem_key, input_hash, input, state, version, error, created_at, updated_at, finished_at)
  select encode(set_byte(set_byte(overlay(r placing substring(int8send(ms) from 3 for 6) from 1 for 6),
      6, (get_byte(r, 6) & 15) | 112), 8, (get_byte(r, 8) & 63) | 128), 'hex')::uuid,
    'transfer', 'prefill-' || lpad(g::text, 10, '0'), sha256(('prefill-' || g)::bytea),
    jsonb_build_object('from', 1, 'to', 1, 'amount', 1),
    case when g % 20 = 0 then 'compensated' else 'credited' end, case when g % 20 = 0 then 4 else 3 end,
    case when g % 20 = 0 then 'step "credit" failed: destination account missing or frozen (prefill)' end,
    now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
  from generate_series($1::int, $2::int) g,
    lateral (select decode(md5('prefill-' || g), 'hex') as r,
      (extract(epoch from now() - interval '1 day') * 1000)::bigint + g as ms) x
  returning id, state, substring(idem_key from 9)::int as g
), st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, last_error, result, created_at, updated_at, dispatched_at)
  select s.id, x.step, x.phase, x.idx, md5(s.id::text || x.step || x.phase)::uuid, x.status,
    case when x.step = 'credit' and s.g % 100 = 50 then 2 else 1 end,
    case when x.status = 'failed' then 'destination account missing or frozen (prefill)' end,
    case when x.amount is not null then jsonb_build_object('account', 1, 'amount', x.amount) end,
    now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
  from s join (values ('deduct', 'forward', 0, 'succeeded', -1, 'any'), ('credit', 'forward', 1, 'succeeded', 1, 'credited'),
      ('credit', 'forward', 1, 'failed', null, 'compensated'), ('deduct', 'compensate', 0, 'succeeded', 1, 'compensated')) x(step, phase, idx, status, amount, kind)
    on x.kind in ('any', s.state)
  returning saga_id, step, phase, key, status, attempt
), at as (
  insert into idemsaga.step_attempts (saga_id, step, phase, attempt, dispatched_at, finished_at, outcome, error)
  select saga_id, step, phase, 1, now() - interval '1 day', now() - interval '1 day', 'retry', 'a transient error (prefill)'
  from st where attempt = 2
), ib as (
  insert into idemsaga.inbox (step_key, saga_id, step, phase, attempt, outcome, created_at)
  select key, saga_id, step, phase, attempt, status, now() - interval '1 day' from st
)
insert into transfer.ledger (saga_id, step, account_id, amount, created_at)
select saga_id, case when phase = 'compensate' then 'refund' else step end, 1,
  case when step = 'deduct' and phase = 'forward' then -1 else 1 end, now() - interval '1 day'
from st where status = 'succeeded'`
