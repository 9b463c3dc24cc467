package crossborder_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
	"github.com/idemsaga/idemsaga/service"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var migration = service.Migration{Schema: crossborder.Schema, Files: crossborder.Migrations}

// Accounts as Seed opens them: 1 EUR, 2 USD, 3 GBP, 4 EUR, 5 USD, 6 GBP
// (frozen).
const (
	eur1, usd2, gbp3, eur4, usd5, frozenGBP6 = 1, 2, 3, 4, 5, 6
	opening                                  = 1_000_000
)

// newEnv runs the transfer (and so its FX child) on a seeded database;
// the desk holds position of each currency.
func newEnv(t *testing.T, position int64) *sagatest.Env {
	t.Helper()
	return sagatest.New(t, sagatest.Config{
		Definitions: []*saga.Definition{crossborder.Definition},
		Migrations:  []service.Migration{migration},
		Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
			return crossborder.Seed(ctx, pool, 6, opening, position, frozenGBP6)
		},
	})
}

func balance(t *testing.T, env *sagatest.Env, account int64) int64 {
	t.Helper()
	var b int64
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select balance from crossborder.accounts where id = $1`, account).Scan(&b))
	return b
}

func audit(t *testing.T, env *sagatest.Env) crossborder.Report {
	t.Helper()
	rep, err := crossborder.Audit(context.Background(), env.Pool)
	require.NoError(t, err)
	require.Empty(t, rep.Differences)
	diffs, err := engine.Reconcile(context.Background(), env.Pool, []*saga.Definition{crossborder.Definition, crossborder.FX}, 0)
	require.NoError(t, err)
	require.Empty(t, diffs)
	return rep
}

func TestDefinitions(t *testing.T) {
	t.Parallel()
	d := crossborder.Definition
	require.Equal(t, crossborder.StateCredited, d.FinalState())
	name, _, ok := d.Child(1)
	require.True(t, ok)
	require.Equal(t, crossborder.FXName, name)
	require.Equal(t, []*saga.Definition{crossborder.FX}, d.Children())
	_, err := d.Input([]byte(`{"from":1,"to":1,"amount":5}`))
	require.ErrorContains(t, err, "same account")
	_, err = crossborder.FX.Input([]byte(`{"sell":"EUR","buy":"EUR","amount":5}`))
	require.ErrorContains(t, err, "nothing to convert")
}

// TestOneCurrency: both accounts hold EUR: the fx step is skipped (no
// child, nothing to compensate) and the credit pays what the debit took.
func TestOneCurrency(t *testing.T) {
	t.Parallel()
	env := newEnv(t, opening)
	sg := env.Run(t, crossborder.Definition, "t-1", crossborder.Input{From: eur1, To: eur4, Amount: 250})
	require.Equal(t, crossborder.StateCredited, sg.State)
	require.Empty(t, sg.Children)
	require.Equal(t, []string{crossborder.StepFX}, sg.Skipped)
	require.EqualValues(t, opening-250, balance(t, env, eur1))
	require.EqualValues(t, opening+250, balance(t, env, eur4))
	rep := audit(t, env)
	require.Equal(t, map[string]int{"credited": 1}, rep.ByState)
}

// TestAcrossCurrencies: EUR to USD runs the FX child, whose results are
// the step's; the credit pays what the conversion bought.
func TestAcrossCurrencies(t *testing.T) {
	t.Parallel()
	env := newEnv(t, opening)
	sg := env.Run(t, crossborder.Definition, "t-1", crossborder.Input{From: eur1, To: usd2, Amount: 1000})
	require.Equal(t, crossborder.StateCredited, sg.State, sg.Error)
	require.Len(t, sg.Children, 1)
	require.Equal(t, saga.State("converted"), sg.Children[0].State)
	var fx crossborder.FXResult
	require.NoError(t, json.Unmarshal(sg.Results[crossborder.StepFX], &fx))
	require.Equal(t, crossborder.Conversion{Sell: "EUR", Buy: "USD", Sold: 1000, Bought: 1080}, fx.Convert)
	var paid crossborder.Credit
	require.NoError(t, json.Unmarshal(sg.Results[crossborder.StepCredit], &paid))
	require.Equal(t, crossborder.Credit{Account: usd2, Amount: 1080, Currency: "USD"}, paid)
	require.EqualValues(t, opening-1000, balance(t, env, eur1))
	require.EqualValues(t, opening+1080, balance(t, env, usd2))
	rep := audit(t, env)
	require.Equal(t, map[string]int{"converted": 1}, rep.Children)
}

// TestDeskShort: the desk cannot pay the GBP: the child voids its quote
// and ends compensated, the fx step fails without effect, and the
// transfer refunds the debit.
func TestDeskShort(t *testing.T) {
	t.Parallel()
	env := newEnv(t, 100)
	sg := env.Run(t, crossborder.Definition, "t-1", crossborder.Input{From: usd2, To: gbp3, Amount: 5000})
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, "was compensated")
	require.Equal(t, saga.StateCompensated, sg.Children[0].State)
	child, err := env.Client.Get(context.Background(), sg.Children[0].ID)
	require.NoError(t, err)
	require.Contains(t, child.Error, crossborder.ErrDeskShort.Error())
	require.EqualValues(t, opening, balance(t, env, usd2), "the debit was refunded")
	audit(t, env)
}

// TestCreditRefusedAfterTheConversion: the destination is frozen; the
// child, which converted, is compensated whole (the conversion reversed,
// the quote voided) before the debit is refunded.
func TestCreditRefusedAfterTheConversion(t *testing.T) {
	t.Parallel()
	env := newEnv(t, opening)
	sg := env.Run(t, crossborder.Definition, "t-1", crossborder.Input{From: eur1, To: frozenGBP6, Amount: 700})
	require.Equal(t, saga.StateCompensated, sg.State)
	require.Contains(t, sg.Error, crossborder.ErrDestinationUnavailable.Error())
	child, err := env.Client.Get(context.Background(), sg.Children[0].ID)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, child.State)
	require.Equal(t, "compensate", child.Repairs[0].Operation)
	require.EqualValues(t, opening, balance(t, env, eur1))
	var desk int64
	require.NoError(t, env.Pool.QueryRow(context.Background(), `select position from crossborder.desk where currency = 'GBP'`).Scan(&desk))
	require.EqualValues(t, opening, desk, "the conversion was reversed")
	audit(t, env)
}

// TestUnderFaults: 30 transfers across and within currencies, some to the
// frozen account, run at once while every step of both definitions has
// its outcome lost, its worker crash after commit, or its command
// delivered twice: each movement happens once, the audit and reconcile
// find nothing.
func TestUnderFaults(t *testing.T) {
	t.Parallel()
	env := newEnv(t, opening)
	for _, step := range []string{crossborder.StepDebit, crossborder.StepFX, crossborder.StepCredit, crossborder.StepQuote, crossborder.StepConvert} {
		env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: step, Times: 4})
		env.Inject(sagatest.Fault{Kind: sagatest.CrashAfterCommit, Step: step, Times: 2})
		env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: step, Times: 2})
	}
	for _, step := range []string{crossborder.StepDebit, crossborder.StepQuote, crossborder.StepConvert} {
		env.Inject(sagatest.Fault{Kind: sagatest.DeliverTwice, Step: step, Phase: saga.PhaseCompensate, Times: 2})
		env.Inject(sagatest.Fault{Kind: sagatest.CrashAfterCommit, Step: step, Phase: saga.PhaseCompensate, Times: 1})
	}
	var wg sync.WaitGroup
	states := make([]saga.State, 30)
	for i := range states {
		wg.Go(func() {
			from := int64(1 + i%5)
			to := int64(1 + (i+1+i/5)%5)
			if from == to {
				to = 1 + to%5
			}
			if i%6 == 5 {
				to = frozenGBP6
			}
			states[i] = env.Run(t, crossborder.Definition, fmt.Sprintf("t-%02d", i), crossborder.Input{From: from, To: to, Amount: int64(100 + i)}).State
		})
	}
	wg.Wait()
	for i, st := range states {
		if i%6 == 5 {
			require.Equal(t, saga.StateCompensated, st, "transfer %d, to the frozen account", i)
		} else {
			require.Equal(t, crossborder.StateCredited, st, "transfer %d", i)
		}
	}
	for _, k := range []sagatest.FaultKind{sagatest.DeliverTwice, sagatest.CrashAfterCommit, sagatest.LoseOutcome} {
		require.Positive(t, env.Fired(k), "fault %d fired", k)
	}
	rep := audit(t, env)
	require.Equal(t, 25, rep.ByState["credited"])
	require.Equal(t, 5, rep.ByState["compensated"])
	require.Positive(t, rep.Children["converted"])
	require.Positive(t, rep.Children["compensated"])
}

// TestAuditFindsDifferences proves the audit can fail.
func TestAuditFindsDifferences(t *testing.T) {
	t.Parallel()
	env := newEnv(t, opening)
	env.Run(t, crossborder.Definition, "t-1", crossborder.Input{From: eur1, To: usd2, Amount: 1000})
	env.Run(t, crossborder.Definition, "t-2", crossborder.Input{From: eur1, To: frozenGBP6, Amount: 10})
	ctx := context.Background()
	// Money appears at the desk, and a compensated transfer's quote
	// stands again.
	_, err := env.Pool.Exec(ctx, `update crossborder.desk set position = position + 5 where currency = 'USD'`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `update crossborder.quotes set voided = false where voided`)
	require.NoError(t, err)
	rep, err := crossborder.Audit(ctx, env.Pool)
	require.NoError(t, err)
	require.Len(t, rep.Differences, 3, "%q", rep.Differences)
	require.Contains(t, rep.Differences[0], "desk holds 998925 USD but opened with 1000000 and its ledger moved -1080")
	require.Contains(t, rep.Differences[1], "USD not conserved")
	require.Contains(t, rep.Differences[2], "is compensated but moved 1 debit, 0 credit, 1 refund, 1 convert, 1 reverse (some holder's money moved for good: false; quotes standing: 1)")
}
