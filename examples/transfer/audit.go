package transfer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Seed replaces all accounts with n accounts numbered 1..n, each holding
// balance, and empties the ledger. Accounts listed in frozen are frozen.
// It returns the total money seeded.
func Seed(ctx context.Context, pool *pgxpool.Pool, n int, balance int64, frozen ...int64) (int64, error) {
	if frozen == nil {
		frozen = []int64{}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, `truncate transfer.ledger, transfer.accounts`); err != nil {
		return 0, fmt.Errorf("seed: %w", err)
	}
	if _, err := tx.Exec(ctx, `insert into transfer.accounts (id, balance, frozen)
select g, $2, g = any($3) from generate_series(1, $1::bigint) g`, n, balance, frozen); err != nil {
		return 0, fmt.Errorf("seed: %w", err)
	}
	if _, err := tx.Exec(ctx, `insert into transfer.seeds (id, accounts, per_account, total) values (1, $1, $2, $3)
on conflict (id) do update set accounts = excluded.accounts, per_account = excluded.per_account, total = excluded.total, seeded_at = now()`,
		n, balance, int64(n)*balance); err != nil {
		return 0, fmt.Errorf("seed: %w", err)
	}
	return int64(n) * balance, tx.Commit(ctx)
}

// Report is the result of Audit.
type Report struct {
	// Total is the money held by all accounts now.
	Total int64
	// ByState counts transfer sagas by state.
	ByState map[string]int
	// Differences lists every broken invariant; empty when all hold.
	Differences []string
}

// Querier is what Audit reads through: a pool, a connection or a
// transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Seeded returns the total recorded by Seed, and false when nothing was
// seeded through it.
func Seeded(ctx context.Context, q Querier) (int64, bool, error) {
	var total int64
	err := q.QueryRow(ctx, `select total from transfer.seeds where id = 1`).Scan(&total)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read seed: %w", err)
	}
	return total, true, nil
}

// Audit checks the example's invariants against the seeded total: money is
// conserved to the unit; every credited saga has exactly one deduct and one
// credit; every compensated saga has one deduct and one refund, or none;
// no ledger row lacks its saga (unless it is older than every saga kept,
// since retention deletes finished sagas but never the ledger); no saga is
// left unfinished.
//
// When the accounts were made by Seed, it also checks each seeded account:
// its balance equals what it was seeded with plus its ledger lines, so an
// effect applied without its ledger line, or twice, is caught.
func Audit(ctx context.Context, q Querier, seeded int64) (Report, error) {
	r := Report{ByState: map[string]int{}}
	if err := q.QueryRow(ctx, `select coalesce(sum(balance), 0) from transfer.accounts`).Scan(&r.Total); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	if r.Total != seeded {
		r.Differences = append(r.Differences, fmt.Sprintf("money not conserved: accounts hold %d, seeded %d (difference %d)", r.Total, seeded, r.Total-seeded))
	}
	rows, err := q.Query(ctx, `select s.id, s.state, s.finished_at is not null,
  count(l.step) filter (where l.step = 'deduct'),
  count(l.step) filter (where l.step = 'credit'),
  count(l.step) filter (where l.step = 'refund'),
  coalesce(sum(l.amount), 0)
from idemsaga.sagas s left join transfer.ledger l on l.saga_id = s.id
where s.definition = 'transfer'
group by s.id, s.state, s.finished_at`)
	if err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, state string
		var done bool
		var d, c, f, sum int64
		if err := rows.Scan(&id, &state, &done, &d, &c, &f, &sum); err != nil {
			return r, fmt.Errorf("audit: %w", err)
		}
		r.ByState[state]++
		switch {
		case !done:
			r.Differences = append(r.Differences, fmt.Sprintf("saga %s is not finished (state %s)", id, state))
		case state == string(StateCredited) && (d != 1 || c != 1 || f != 0 || sum != 0):
			r.Differences = append(r.Differences, fmt.Sprintf("saga %s is credited but its ledger has %d deduct, %d credit, %d refund (net %d)", id, d, c, f, sum))
		case state == "compensated" && !((d == 1 && f == 1 && c == 0 && sum == 0) || (d == 0 && c == 0 && f == 0)):
			r.Differences = append(r.Differences, fmt.Sprintf("saga %s is compensated but its ledger has %d deduct, %d credit, %d refund (net %d)", id, d, c, f, sum))
		case state == "failed":
			r.Differences = append(r.Differences, fmt.Sprintf("saga %s failed and needs a person (ledger: %d deduct, %d credit, %d refund)", id, d, c, f))
		}
	}
	if err := rows.Err(); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	// The ledger is summed once, grouped by account (a correlated sum per
	// account would scan the ledger once per account).
	perAccount, err := q.Query(ctx, `with l as (select account_id, sum(amount) as total from transfer.ledger group by account_id)
select a.id, a.balance, s.per_account + coalesce(l.total, 0)
from transfer.accounts a cross join transfer.seeds s left join l on l.account_id = a.id
where a.id between 1 and s.accounts and a.balance <> s.per_account + coalesce(l.total, 0)
order by a.id`)
	if err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	for perAccount.Next() {
		var id, balance, expected int64
		if err := perAccount.Scan(&id, &balance, &expected); err != nil {
			perAccount.Close()
			return r, fmt.Errorf("audit: %w", err)
		}
		r.Differences = append(r.Differences, fmt.Sprintf("account %d holds %d but its seed and ledger say %d", id, balance, expected))
	}
	if err := perAccount.Err(); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}

	// Ledger rows older than every saga still kept (failed sagas, which
	// retention keeps indefinitely, aside) may belong to sagas retention
	// deleted; only younger rows must have their saga.
	var orphans int
	if err := q.QueryRow(ctx, `select count(*) from transfer.ledger l
where l.created_at >= coalesce((select min(created_at) from idemsaga.sagas where state <> 'failed'), '-infinity')
  and not exists (select 1 from idemsaga.sagas s where s.id = l.saga_id)`).Scan(&orphans); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	if orphans > 0 {
		r.Differences = append(r.Differences, fmt.Sprintf("%d ledger rows belong to no saga", orphans))
	}
	return r, nil
}
