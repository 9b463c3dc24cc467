package crossborder

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Currencies are the currencies Seed opens accounts in, in turn: account
// i holds Currencies[(i-1) % 3].
var Currencies = []string{"EUR", "USD", "GBP"}

// rates are the desk's rates between Currencies, in millionths.
var rates = map[[2]string]int64{
	{"EUR", "USD"}: 1_080_000, {"USD", "EUR"}: 920_000,
	{"EUR", "GBP"}: 860_000, {"GBP", "EUR"}: 1_160_000,
	{"USD", "GBP"}: 790_000, {"GBP", "USD"}: 1_260_000,
}

// Seed replaces the accounts with n accounts numbered 1..n, each holding
// balance in its currency (see Currencies), gives the desk position in
// each currency, sets the desk's rates, and empties the ledger and the
// quotes. Accounts listed in frozen are frozen.
func Seed(ctx context.Context, pool *pgxpool.Pool, n int, balance, position int64, frozen ...int64) error {
	if frozen == nil {
		frozen = []int64{}
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `truncate crossborder.ledger, crossborder.quotes, crossborder.accounts, crossborder.desk, crossborder.rates, crossborder.openings`); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		if _, err := tx.Exec(ctx, `insert into crossborder.accounts (id, currency, balance, frozen)
select g, ($4::text[])[1 + (g - 1) % cardinality($4::text[])], $2, g = any($3) from generate_series(1, $1::bigint) g`, n, balance, frozen, Currencies); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		for pair, micros := range rates {
			if _, err := tx.Exec(ctx, `insert into crossborder.rates (sell, buy, micros) values ($1, $2, $3)`, pair[0], pair[1], micros); err != nil {
				return fmt.Errorf("seed: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `insert into crossborder.desk (currency, position) select unnest($1::text[]), $2`, Currencies, position); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		if _, err := tx.Exec(ctx, `insert into crossborder.openings (holder, currency, amount)
select 'account:' || id, currency, balance from crossborder.accounts
union all
select 'desk', currency, position from crossborder.desk`); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		return nil
	})
}

// Report is the result of Audit.
type Report struct {
	// ByState counts transfers by state, and Children their FX children.
	ByState, Children map[string]int
	// Differences lists every broken invariant; empty when all hold.
	Differences []string
}

// Querier is what Audit reads through: a pool, a connection or a
// transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// auditHolders finds each holder (an account, or the desk) whose balance
// is not its opening plus its ledger rows, and each currency whose money
// is not what was opened.
const auditHolders = `with now_held as (
  select 'account:' || id as holder, currency, balance as amount from crossborder.accounts
  union all
  select 'desk', currency, position from crossborder.desk
), moved as (
  select holder, currency, sum(amount) as amount from crossborder.ledger group by holder, currency
)
select o.holder || ' holds ' || coalesce(n.amount, 0) || ' ' || o.currency || ' but opened with ' || o.amount || ' and its ledger moved ' || coalesce(m.amount, 0)
from crossborder.openings o
left join now_held n using (holder, currency)
left join moved m using (holder, currency)
where coalesce(n.amount, 0) <> o.amount + coalesce(m.amount, 0)
union all
select o.currency || ' not conserved: held ' || n.amount || ', opened ' || o.amount
from (select currency, sum(amount) as amount from crossborder.openings group by currency) o
join (select currency, sum(amount) as amount from now_held group by currency) n using (currency)
where n.amount <> o.amount`

// auditSagas reads each transfer with what it and its child moved.
const auditSagas = `with fam as (
  select p.id as root, x.id from idemsaga.sagas p
  join idemsaga.sagas x on x.id = p.id or x.parent_id = p.id
  where p.definition = 'crossborder'
), rows as (
  select f.root, l.* from fam f join crossborder.ledger l on l.saga_id = f.id
), per_saga as (
  select root,
    count(distinct key) filter (where step = 'debit') as debits,
    count(distinct key) filter (where step = 'credit') as credits,
    count(distinct key) filter (where step = 'refund') as refunds,
    count(distinct key) filter (where step = 'convert') as converts,
    count(distinct key) filter (where step = 'reverse') as reverses
  from rows group by root
), unbalanced as (
  select root, bool_or(by_holder <> 0) as holder, bool_or(by_currency <> 0) as currency from (
    select root, holder, currency, sum(amount) as by_holder, sum(sum(amount)) over (partition by root, currency) as by_currency
    from rows group by root, holder, currency
  ) t group by root
)
select p.id::text, p.state::text, p.finished_at is not null,
  coalesce(c.state::text, ''), c.id is null or c.finished_at is not null,
  coalesce(s.debits, 0), coalesce(s.credits, 0), coalesce(s.refunds, 0), coalesce(s.converts, 0), coalesce(s.reverses, 0),
  coalesce(u.holder, false), coalesce(u.currency, false),
  (select count(*) from crossborder.quotes q where q.saga_id = c.id and not q.voided)
from idemsaga.sagas p
left join idemsaga.sagas c on c.parent_id = p.id
left join per_saga s on s.root = p.id
left join unbalanced u on u.root = p.id
where p.definition = 'crossborder'
order by p.id`

// Audit checks the example's invariants, once no saga runs: every
// holder holds its opening plus its ledger rows, and each currency's
// money is what was opened; a credited transfer was debited once and
// credited once, converted at most once and never reversed, and left
// every currency's money where it was (the desk took what the debit
// took, and paid what the credit paid); a compensated one, its child's
// movements included, moved nothing for good and left no quote standing;
// no transfer or child is unfinished, and none failed.
func Audit(ctx context.Context, q Querier) (Report, error) {
	r := Report{ByState: map[string]int{}, Children: map[string]int{}}
	rows, err := q.Query(ctx, auditHolders)
	if err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	r.Differences = append(r.Differences, held...)

	rows, err = q.Query(ctx, auditSagas)
	if err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, state, child string
		var done, childDone, holder, currency bool
		var debits, credits, refunds, converts, reverses, quotes int
		if err := rows.Scan(&id, &state, &done, &child, &childDone, &debits, &credits, &refunds, &converts, &reverses, &holder, &currency, &quotes); err != nil {
			return r, fmt.Errorf("audit: %w", err)
		}
		r.ByState[state]++
		if child != "" {
			r.Children[child]++
		}
		moves := fmt.Sprintf("%d debit, %d credit, %d refund, %d convert, %d reverse", debits, credits, refunds, converts, reverses)
		switch {
		case !done || !childDone:
			r.Differences = append(r.Differences, fmt.Sprintf("transfer %s is not finished (state %s, child %q)", id, state, child))
		case state == string(StateCredited) && (debits != 1 || credits != 1 || refunds != 0 || converts > 1 || reverses != 0 || currency):
			r.Differences = append(r.Differences, fmt.Sprintf("transfer %s is credited but moved %s (money left in flight: %t)", id, moves, currency))
		case state == "compensated" && (holder || credits != 0 || debits != refunds || converts != reverses || quotes != 0):
			r.Differences = append(r.Differences, fmt.Sprintf("transfer %s is compensated but moved %s (some holder's money moved for good: %t; quotes standing: %d)", id, moves, holder, quotes))
		case state == "failed" || child == "failed":
			r.Differences = append(r.Differences, fmt.Sprintf("transfer %s failed and needs a person (child %q; moved %s)", id, child, moves))
		}
	}
	if err := rows.Err(); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	return r, nil
}
