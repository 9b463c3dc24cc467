package steps_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// BenchmarkExecLastStep runs TxOnly steps whose one statement goes by
// ExecLast, one after another on one connection, each applied in the step
// as a guess would be: one round trip per step. Run against a PostgreSQL
// under callgrind, the instructions of its one backend divided by b.N
// are what a step costs PostgreSQL, free of the machine's noise (see
// docs/benchmarks.md, tenth pass).
func BenchmarkExecLastStep(b *testing.B) {
	ctx := context.Background()
	pool := poolWith(b, effectsDB(b), func(*pgxpool.Config) {})
	def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: lastEffect(0)})
	w, _ := meteredWorker(b, pool, def, func(cfg *steps.Config) {
		cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
			a.Pending.Queue(`insert into effects (saga_id, step) values ($1, 'applied')`, a.Command.SagaID)
			return steps.Applied{Writes: a.Pending}, nil
		}
	})
	for b.Loop() {
		if _, err := w.Handle(ctx, command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)); err != nil {
			b.Fatal(err)
		}
	}
}
