package engine_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// TestGivenUpStepThatTookEffectIsApplied: the credit step (which has no
// compensation) commits, but its reply is lost; its only attempt's lease
// expires. Giving it up must not compensate the deduction while the
// credit stands (that would create money): the engine settles the step
// through the inbox, finds the success, and applies it.
func TestGivenUpStepThatTookEffectIsApplied(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"lease expired", "retryable error reported for the last attempt"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.DB(t)
			_, nc := testenv.NATS(t)
			def, err := fixture.Transfer(saga.RetryPolicy{MaxAttempts: 1, Timeout: time.Second})
			require.NoError(t, err)
			seeded, err := fixture.Seed(ctx, pool, 2, 100)
			require.NoError(t, err)
			e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, LeaseGrace: time.Hour, Logger: quietLogger()})
			require.NoError(t, err)
			w := newReplyWorker(t, pool, "x", 0, def)

			res, err := e.Client().Start(ctx, def, "k", transferInput(1, 2, 30))
			require.NoError(t, err)
			input, err := json.Marshal(transferInput(1, 2, 30))
			require.NoError(t, err)
			run := func(step string) wire.Reply {
				r, err := w.Handle(ctx, wire.Command{SagaID: res.ID, Definition: def.Name(), Step: step, Phase: saga.PhaseForward,
					Key: saga.StepKey(res.ID, step, saga.PhaseForward), Attempt: 1, Input: input})
				require.NoError(t, err)
				return r
			}
			v, err := e.ApplyReply(ctx, run(fixture.StepDeduct))
			require.NoError(t, err)
			require.Equal(t, engine.VerdictApplied, v)
			credit := run(fixture.StepCredit) // committed; its reply is lost
			require.Equal(t, wire.OutcomeSucceeded, credit.Outcome)

			switch how {
			case "lease expired":
				_, err = pool.Exec(ctx, `update idemsaga.steps set lease_until = now() - interval '1 second' where step = 'credit'`)
				require.NoError(t, err)
				moved, err := e.ReapOnce(ctx)
				require.NoError(t, err)
				require.Equal(t, 1, moved)
			default:
				// Another delivery of the same attempt failed before the
				// success committed, and only its reply arrived.
				failed := credit
				failed.Outcome, failed.Result, failed.Error = wire.OutcomeRetry, nil, "connection reset"
				v, err := e.ApplyReply(ctx, failed)
				require.NoError(t, err)
				require.Equal(t, engine.VerdictApplied, v)
			}
			sg, err := e.Client().Get(ctx, res.ID)
			require.NoError(t, err)
			require.Equal(t, fixture.StateCredited, sg.State)
			rep, err := fixture.Audit(ctx, pool, seeded)
			require.NoError(t, err)
			require.Empty(t, rep.Differences)
		})
	}
}
