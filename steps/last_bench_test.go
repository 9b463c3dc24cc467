package steps_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/wire"
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

// BenchmarkDuplicateStep delivers again, one after another on one
// connection, commands whose attempts committed, as a copy under a new
// message id reaches a worker that does not remember it (Config.Recent -1):
// as a first delivery (its claim's raise answers it), and as a
// redelivery (a read of the inbox answers it). Under
// scripts/pg-instructions.sh, what a duplicate costs PostgreSQL.
func BenchmarkDuplicateStep(b *testing.B) {
	for _, redelivered := range []bool{false, true} {
		name := "claimed"
		if redelivered {
			name = "redelivered"
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			pool := poolWith(b, effectsDB(b), func(*pgxpool.Config) {})
			def := saga.MustNew("last", saga.Step{Name: "write", Reaches: "written", TxOnly: true, Forward: lastEffect(0)})
			w, _ := meteredWorker(b, pool, def, func(cfg *steps.Config) {
				cfg.Recent = -1
				cfg.ApplyFunc = func(_ context.Context, a steps.Apply) (steps.Applied, error) {
					a.Pending.Queue(`insert into effects (saga_id, step) values ($1, 'applied')`, a.Command.SagaID)
					return steps.Applied{Writes: a.Pending}, nil
				}
			})
			const done = 1000
			cmds := make([]wire.Command, done)
			for i := range cmds {
				cmds[i] = command(uuid.New(), "last", "write", saga.PhaseForward, 1, 1)
				if _, err := w.Handle(ctx, cmds[i]); err != nil {
					b.Fatal(err)
				}
			}
			i := 0
			for b.Loop() {
				var err error
				var r wire.Reply
				if redelivered {
					r, err = w.HandleRedelivered(ctx, cmds[i%done])
				} else {
					r, err = w.Handle(ctx, cmds[i%done])
				}
				if err != nil || !r.Duplicate {
					b.Fatalf("a duplicate was not answered as one: %v, %+v", err, r)
				}
				i++
			}
		})
	}
}
