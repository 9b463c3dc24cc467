package transfer_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestInputValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, transfer.Input{From: 1, To: 2, Amount: 1}.Validate())
	require.ErrorContains(t, transfer.Input{From: 1, To: 2, Amount: 0}.Validate(), "amount must be positive")
	require.ErrorContains(t, transfer.Input{From: 1, To: 2, Amount: -3}.Validate(), "amount must be positive")
	require.ErrorContains(t, transfer.Input{From: 4, To: 4, Amount: 3}.Validate(), "same account")
}

func TestDefinitionShape(t *testing.T) {
	t.Parallel()
	d := transfer.Definition
	require.Equal(t, "transfer", d.Name())
	require.Equal(t, transfer.StateCredited, d.FinalState())
	require.True(t, d.CanTransition(saga.StateInit, transfer.StateDeducted))
	require.True(t, d.CanTransition(transfer.StateDeducted, transfer.StateCredited))
	require.NotNil(t, d.Step(0).Compensate, "deduct is refunded")
	require.Nil(t, d.Step(1).Compensate, "credit is the last step: nothing after it can fail")
}

// TestAuditFindsDifferences proves the audit can fail: each kind of broken
// invariant planted by hand is reported.
func TestAuditFindsDifferences(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	seeded, err := transfer.Seed(ctx, pool, 3, 100)
	require.NoError(t, err)
	rep, err := transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences, "a fresh seed is consistent")

	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition}})
	require.NoError(t, err)
	res, err := cl.Start(ctx, transfer.Definition, "k", transfer.Input{From: 1, To: 2, Amount: 10})
	require.NoError(t, err)
	rep, err = transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Len(t, rep.Differences, 1)
	require.Contains(t, rep.Differences[0], "not finished")

	// Pretend it was credited while only the deduction happened, and money
	// leaked out of the system.
	_, err = pool.Exec(ctx, `update idemsaga.sagas set state = 'credited', finished_at = now() where id = $1`, res.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update transfer.accounts set balance = balance - 10 where id = 1`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `insert into transfer.ledger (saga_id, step, account_id, amount) values ($1, 'deduct', 1, -10), ($2, 'credit', 2, 5)`, res.ID, uuid.New())
	require.NoError(t, err)
	rep, err = transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Len(t, rep.Differences, 4, "%v", rep.Differences)
	require.Contains(t, rep.Differences[0], "money not conserved")
	require.Contains(t, rep.Differences[1], "credited but its ledger has 1 deduct, 0 credit")
	require.Contains(t, rep.Differences[2], "account 2 holds 100 but its seed and ledger say 105")
	require.Contains(t, rep.Differences[3], "1 ledger rows belong to no saga")

	total, ok, err := transfer.Seeded(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, seeded, total)
}

// TestAuditCatchesAnEffectAppliedTwice: money moved twice between two
// accounts with one ledger line each conserves the total, but not the
// accounts' balances against their ledgers.
func TestAuditCatchesAnEffectAppliedTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	seeded, err := transfer.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update transfer.accounts set balance = balance + case id when 1 then -10 else 10 end`)
	require.NoError(t, err)
	rep, err := transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Equal(t, []string{"account 1 holds 90 but its seed and ledger say 100", "account 2 holds 110 but its seed and ledger say 100"}, rep.Differences)
}

// TestTablesRefuseWhatNoTransferWrites: the rules on the example's tables
// (migration 004, as domains) hold whatever writes them: no balance goes
// below zero, and a ledger row's step is one of the transfer's.
func TestTablesRefuseWhatNoTransferWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, err := transfer.Seed(ctx, pool, 1, 10)
	require.NoError(t, err)
	for _, tc := range []struct{ name, sql string }{
		{"a negative balance", `update transfer.accounts set balance = balance - 11 where id = 1`},
		{"an unknown step", `insert into transfer.ledger (saga_id, step, account_id, amount) values (gen_random_uuid(), 'gift', 1, 5)`},
	} {
		_, err := pool.Exec(ctx, tc.sql)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, tc.name)
		require.Equal(t, "23514", pgErr.Code, tc.name) // check_violation
	}
	var balance int64
	require.NoError(t, pool.QueryRow(ctx, `select balance from transfer.accounts where id = 1`).Scan(&balance))
	require.Equal(t, int64(10), balance)
}
