package crossborder

// Each movement is one statement: the balance changes and its ledger row
// is written together, or nothing changes and the handler reads why.
const (
	// debitSQL takes $2 from account $1, if it holds that much and is not
	// frozen, and answers the account's currency; $3 is the step key, $4
	// the saga.
	debitSQL = `with a as (
  update crossborder.accounts set balance = balance - $2 where id = $1 and balance >= $2 and not frozen returning id, currency
), l as (
  insert into crossborder.ledger (key, currency, saga_id, step, holder, amount)
  select $3, currency, $4, 'debit', 'account:' || id, -$2::bigint from a
)
select currency from a`

	// creditSQL pays $2 into account $1 if it is not frozen and holds
	// currency $5; $3 is the step key, $4 the saga, $6 the step.
	creditSQL = `with a as (
  update crossborder.accounts set balance = balance + $2 where id = $1 and currency = $5 and ($6 = 'refund' or not frozen) returning id, currency
)
insert into crossborder.ledger (key, currency, saga_id, step, holder, amount)
select $3, currency, $4, $6, 'account:' || id, $2::bigint from a`

	// accountOf reads an account, to tell a refused movement's causes
	// apart and to learn the destination's currency.
	accountOf = `select currency, frozen from crossborder.accounts where id = $1`

	// quoteSQL fixes the rate of selling $4 units of $2 for $3 under key
	// $1, for saga $5, and answers the rate and what it buys; no row: no
	// rate.
	quoteSQL = `with r as (
  select micros, $4::bigint * micros / 1000000 as bought from crossborder.rates where sell = $2 and buy = $3
), q as (
  insert into crossborder.quotes (key, saga_id, sell, buy, sold, bought, micros)
  select $1, $5, $2, $3, $4, bought, micros from r where bought > 0
)
select micros, bought from r`

	// voidSQL voids the quotes of saga $1.
	voidSQL = `update crossborder.quotes set voided = true where saga_id = $1`

	// lockDesk locks the desk's rows of currencies $1 and $2, always in
	// the same order, before a conversion changes them: two conversions
	// of a pair in opposite directions would otherwise each hold one row
	// and wait for the other's.
	lockDesk = `select currency from crossborder.desk where currency in ($1, $2) order by currency for no key update`

	// convertSQL takes $3 of currency $1 into the desk and pays $4 of $2
	// out of it, if it holds that much, under key $5 of saga $6 and step
	// $7; it answers a row when it converted.
	convertSQL = `with pay as (
  update crossborder.desk set position = position - $4 where currency = $2 and position >= $4 returning currency
), take as (
  update crossborder.desk set position = position + $3 where currency = $1 and exists (select from pay) returning currency
), l as (
  insert into crossborder.ledger (key, currency, saga_id, step, holder, amount)
  select $5::uuid, $1::text, $6::uuid, $7::text, 'desk', $3::bigint from take
  union all
  select $5::uuid, $2::text, $6::uuid, $7::text, 'desk', -$4::bigint from pay where exists (select from take)
)
select 1 from take`
)
