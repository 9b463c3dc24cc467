package settlement

const (
	// settleSQL totals the ledger rows booked in [$2, $3) and records them
	// as day $1's settlement under step key $4, or finds the day settled
	// already: it answers the key the day is settled under (the caller's,
	// or another saga's) with that settlement's totals. The insert's row
	// is not visible to the second select of the same statement, hence
	// the union. When another saga's settle of the same day commits
	// while this one waits on its row, it answers no row: the attempt
	// fails and is retried, and the next one reads the winner's key.
	settleSQL = `with t as (
  select count(*) as entries, coalesce(sum(amount), 0)::bigint as total
  from settlement.ledger where booked_at >= $2 and booked_at < $3
), ins as (
  insert into settlement.settlements (day, step_key, saga_id, entries, total)
  select $1::date, $4, $5, entries, total from t
  on conflict (day) do nothing
  returning step_key, entries, total
)
select step_key, entries, total from ins
union all
select step_key, entries, total from settlement.settlements where day = $1::date and not exists (select 1 from ins)`

	// unsettleSQL deletes the settlement recorded under step key $1.
	unsettleSQL = `delete from settlement.settlements where step_key = $1 returning entries, total`
)
