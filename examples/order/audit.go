package order

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Seed replaces all products with n products numbered 1..n, each with
// stock units, and records them for the audit.
func Seed(ctx context.Context, pool *pgxpool.Pool, n int, stock int64) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, q := range []string{
			`truncate orders.shipments, orders.reservations, orders.seeds`,
			`delete from orders.products`,
		} {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("seed: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `insert into orders.products (id, stock) select g, $2 from generate_series(1, $1::bigint) g`, n, stock); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		if _, err := tx.Exec(ctx, `insert into orders.seeds (product_id, stock) select id, stock from orders.products`); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		return nil
	})
}

// Report is the result of Audit.
type Report struct {
	// ByState counts order sagas by state.
	ByState map[string]int
	// Charged is the money the payment service holds (charges not
	// refunded), and Shipped what the shipped orders cost.
	Charged, Shipped int64
	// Refunded and Voided count charges given back, and keys refunded
	// before any charge arrived.
	Refunded, Voided int
	// Parked counts the orders parked for a person, ParkedCharged those
	// of them whose charge took effect, and ParkedHeld the money those
	// hold (a person decides; the money check counts it apart).
	Parked, ParkedCharged int
	ParkedHeld            int64
	// Differences lists every broken invariant; empty when all hold.
	Differences []string
}

// Querier is what Audit reads through.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Audit checks the example's invariants across the engine's sagas, the
// order tables and the payment service's, by its own SQL:
//
//   - no order is charged twice;
//   - every charged order is shipped, or its charge refunded: a shipped
//     order holds exactly one charge of its amount, a compensated one none;
//     a physical order in state shipped has its shipment, a digital one
//     skipped shipping and has none;
//   - the money the payment service holds equals the shipped orders' total
//     (and what parked orders hold, which a person decides);
//   - stock is conserved: each product holds what it was seeded with, less
//     what its shipped orders reserved; no compensated order keeps a
//     reservation or a shipment;
//   - no order saga is left unfinished, failed or parked.
func Audit(ctx context.Context, q Querier) (Report, error) {
	r := Report{ByState: map[string]int{}}
	add := func(format string, args ...any) { r.Differences = append(r.Differences, fmt.Sprintf(format, args...)) }
	each := func(sql string, scan func(pgx.Rows) error) error {
		rows, err := q.Query(ctx, sql)
		if err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			if err := scan(rows); err != nil {
				return fmt.Errorf("audit: %w", err)
			}
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("audit: %w", err)
		}
		return nil
	}

	// Charged twice: two charges of one order that took money.
	if err := each(`select order_id::text, count(*) from payments.charges where state in ('charged', 'refunded')
group by order_id having count(*) > 1`, func(rows pgx.Rows) error {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return err
		}
		add("order %s was charged %d times", id, n)
		return nil
	}); err != nil {
		return r, err
	}

	// Each order saga against its charge (under its charge step's key),
	// its reservation and its shipment.
	if err := each(`select s.id::text, s.state::text, s.finished_at is not null, (s.input->>'amount')::bigint,
  c.state, coalesce(c.amount, 0), r.saga_id is not null, sh.saga_id is not null,
  coalesce((s.input->>'digital')::bool, false), 'ship' = any(s.skipped)
from idemsaga.sagas s
left join idemsaga.steps st on st.saga_id = s.id and st.step = 'charge' and st.phase = 'forward'
left join payments.charges c on c.key = st.key
left join orders.reservations r on r.saga_id = s.id
left join orders.shipments sh on sh.saga_id = s.id
where s.definition = 'order'`, func(rows pgx.Rows) error {
		var id, state string
		var done, reserved, shipped, digital, skipped bool
		var amount, charged int64
		var charge *string
		if err := rows.Scan(&id, &state, &done, &amount, &charge, &charged, &reserved, &shipped, &digital, &skipped); err != nil {
			return err
		}
		r.ByState[state]++
		cs := "none"
		if charge != nil {
			cs = *charge
		}
		switch {
		case !done:
			add("order %s is not finished (state %s)", id, state)
		case state == string(StateShipped):
			r.Shipped += amount
			if cs != "charged" || charged != amount || !reserved || shipped == digital || skipped != digital {
				add("order %s (digital %v) is shipped but its charge is %s (%d of %d), reserved %v, shipment %v, shipping skipped %v", id, digital, cs, charged, amount, reserved, shipped, skipped)
			}
		case state == "compensated":
			if cs == "charged" || reserved || shipped {
				add("order %s is compensated but its charge is %s, reserved %v, shipment %v", id, cs, reserved, shipped)
			}
		default:
			if state == "parked" {
				r.Parked++
				if cs == "charged" {
					r.ParkedCharged++
					r.ParkedHeld += charged
				}
			}
			add("order %s is %s and needs a person (charge %s, reserved %v)", id, state, cs, reserved)
		}
		return nil
	}); err != nil {
		return r, err
	}

	if err := q.QueryRow(ctx, `select coalesce(sum(amount) filter (where state = 'charged'), 0),
  count(*) filter (where state = 'refunded'), count(*) filter (where state = 'voided')
from payments.charges`).Scan(&r.Charged, &r.Refunded, &r.Voided); err != nil {
		return r, fmt.Errorf("audit: %w", err)
	}
	if r.Charged != r.Shipped+r.ParkedHeld {
		add("the payment service holds %d, but the shipped orders cost %d and the parked ones hold %d (difference %d)", r.Charged, r.Shipped, r.ParkedHeld, r.Charged-r.Shipped-r.ParkedHeld)
	}

	// Stock conserved, per product.
	if err := each(`select p.id, p.stock, sd.stock, coalesce(sum(r.quantity), 0)
from orders.products p join orders.seeds sd on sd.product_id = p.id
left join orders.reservations r on r.product_id = p.id
group by p.id, p.stock, sd.stock
having p.stock + coalesce(sum(r.quantity), 0) <> sd.stock`, func(rows pgx.Rows) error {
		var id, stock, seeded, reserved int64
		if err := rows.Scan(&id, &stock, &seeded, &reserved); err != nil {
			return err
		}
		add("product %d holds %d with %d reserved, but was seeded with %d", id, stock, reserved, seeded)
		return nil
	}); err != nil {
		return r, err
	}
	return r, nil
}
