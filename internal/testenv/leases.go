package testenv

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// leasesRunOut lists what the engine recorded of leases that ran out: an
// attempt taken over ("lease expired" in a step's timeline), or a command
// found lost and sent again at its attempt (resent_attempt).
const leasesRunOut = `select saga_id::text || ' ' || step || '/' || phase || ' attempt ' || attempt || ': taken over' from idemsaga.step_attempts where outcome = 'lease expired'
union all
select saga_id::text || ' ' || step || '/' || phase || ' attempt ' || resent_attempt || ': command found lost, sent again' from idemsaga.steps where resent_attempt is not null`

// LeasesRunOut returns what pool's engine recorded of leases that ran out
// and that it acted on, one line each: a test of failover asserts it is
// empty (nothing waited for a lease) rather than a bound on wall time.
func LeasesRunOut(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	rows, err := pool.Query(ctx, leasesRunOut)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
