package transfer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
	"github.com/idemsaga/idemsaga/service"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// db returns a database of the test's own with the example's tables and
// no engine running.
func db(t *testing.T) *pgxpool.Pool {
	t.Helper()
	return sagatest.Database(t, service.Migration{Schema: transfer.Schema, Files: transfer.Migrations})
}

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
	pool := db(t)
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
	pool := db(t)
	seeded, err := transfer.Seed(ctx, pool, 2, 100)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `update transfer.accounts set balance = balance + case id when 1 then -10 else 10 end`)
	require.NoError(t, err)
	rep, err := transfer.Audit(ctx, pool, seeded)
	require.NoError(t, err)
	require.Equal(t, []string{"account 1 holds 90 but its seed and ledger say 100", "account 2 holds 110 but its seed and ledger say 100"}, rep.Differences)
}

// TestTablesRefuseWhatNoTransferWrites: the rules on the example's tables
// (domains) hold whatever writes them: no balance goes below zero, and a
// ledger row's step is one of the transfer's.
func TestTablesRefuseWhatNoTransferWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := db(t)
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

// TestStepsRefuseWhatCannotTakeEffect runs transfers between accounts
// that cannot pay or be paid: each saga ends compensated with the error
// that says why, and no balance changed. A transfer that can pay moves
// the money once, through a crash after its debit's commit and a second
// delivery of its credit.
func TestStepsRefuseWhatCannotTakeEffect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var seeded int64
	env := sagatest.New(t, sagatest.Config{
		Definitions: []*saga.Definition{transfer.Definition},
		Migrations:  []service.Migration{{Schema: transfer.Schema, Files: transfer.Migrations}},
		// Account 3 is frozen; account 9 does not exist.
		Setup: func(ctx context.Context, pool *pgxpool.Pool) (err error) {
			seeded, err = transfer.Seed(ctx, pool, 3, 100, 3)
			return err
		},
	})
	for i, tc := range []struct {
		name string
		in   transfer.Input
		want error
	}{
		{"a debit beyond the balance", transfer.Input{From: 1, To: 2, Amount: 101}, transfer.ErrInsufficientFunds},
		{"a debit of a frozen account", transfer.Input{From: 3, To: 2, Amount: 1}, transfer.ErrSourceUnavailable},
		{"a debit of a missing account", transfer.Input{From: 9, To: 2, Amount: 1}, transfer.ErrSourceUnavailable},
		{"a credit of a frozen account", transfer.Input{From: 1, To: 3, Amount: 1}, transfer.ErrDestinationMissing},
		{"a credit of a missing account", transfer.Input{From: 1, To: 9, Amount: 1}, transfer.ErrDestinationMissing},
	} {
		sg := env.Run(t, transfer.Definition, fmt.Sprintf("refused-%d", i), tc.in)
		require.Equal(t, saga.StateCompensated, sg.State, tc.name)
		require.Contains(t, sg.Error, tc.want.Error(), tc.name)
	}
	var balances []int64
	require.NoError(t, env.Pool.QueryRow(ctx, `select array_agg(balance order by id) from transfer.accounts`).Scan(&balances))
	require.Equal(t, []int64{100, 100, 100}, balances, "no refusal moved money")

	env.Inject(sagatest.Fault{Kind: sagatest.CrashAfterCommit, Step: transfer.StepDeduct})
	env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: transfer.StepCredit})
	sg := env.Run(t, transfer.Definition, "pays", transfer.Input{From: 1, To: 2, Amount: 100})
	require.Equal(t, transfer.StateCredited, sg.State)
	require.NoError(t, env.Pool.QueryRow(ctx, `select array_agg(balance order by id) from transfer.accounts`).Scan(&balances))
	require.Equal(t, []int64{0, 200, 100}, balances, "moved once")
	rep, err := transfer.Audit(ctx, env.Pool, seeded)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
}

// TestCheckMigrated: tables that lack one of this build's migrations, or
// all of them, are refused, saying what to do; migrated, they pass.
func TestCheckMigrated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := db(t)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	require.NoError(t, transfer.CheckMigrated(ctx, conn.Conn()))
	_, err = conn.Exec(ctx, `update transfer.schema_version set version = version - 1`)
	require.NoError(t, err)
	require.ErrorContains(t, transfer.CheckMigrated(ctx, conn.Conn()), "apply the migrations first")
	_, err = conn.Exec(ctx, `drop schema transfer cascade`)
	require.NoError(t, err)
	require.ErrorContains(t, transfer.CheckMigrated(ctx, conn.Conn()), "apply the migrations first")
	require.NoError(t, transfer.Migrate(ctx, conn.Conn()))
	require.NoError(t, transfer.CheckMigrated(ctx, conn.Conn()))
}
