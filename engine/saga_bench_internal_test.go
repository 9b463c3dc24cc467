package engine

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/idemsaga/idemsaga/internal/maintenance"

	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// BenchmarkTransferSaga runs whole transfer sagas, one after another, on
// one connection: the start, then the debit and the credit as the
// engine's step workers run them (each applied to its saga in the step's
// own transaction). "eager" runs the debit as a delivery from the broker
// and the credit at once after it, claimed with the debit's COMMIT, as
// the engine does; "alone" runs each as one attempt (Handle), the commands
// handed from one to the next in memory. Nothing else runs: no relay (the outbox
// rows stay; the relay deletes them in batches), no reaper, no
// orchestrator. Under bench/pg-instructions.sh, the instructions of the
// one backend over b.N are what the happy path of a saga costs PostgreSQL.
// "eager-traced" is "eager" with a TracerProvider that samples every span
// (into a batcher that drops them): what tracing costs when it is on.
func BenchmarkTransferSaga(b *testing.B) {
	b.Run("eager", func(b *testing.B) { benchmarkTransferSaga(b, true, false) })
	b.Run("alone", func(b *testing.B) { benchmarkTransferSaga(b, false, false) })
	b.Run("eager-traced", func(b *testing.B) { benchmarkTransferSaga(b, true, true) })
}

func benchmarkTransferSaga(b *testing.B, eager, traced bool) {
	ctx := context.Background()
	shared := testenv.DB(b)
	if _, err := fixture.Seed(ctx, shared, 2, 1<<50); err != nil {
		b.Fatal(err)
	}
	pcfg := shared.Config().Copy()
	pcfg.MaxConns, pcfg.MinConns = 1, 0
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)

	def, err := fixture.Transfer(saga.RetryPolicy{})
	if err != nil {
		b.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := Config{Pool: pool, Definitions: []*saga.Definition{def}, Logger: quiet}
	if traced {
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(tracetest.NewNoopExporter()))
		b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		cfg.TracerProvider = tp
	}
	cfg = *cfg.WithDefaults()
	if err := cfg.validate(false); err != nil {
		b.Fatal(err)
	}
	// What a transaction commits is handed on here, as the engine's
	// publish after commit would hand it to the broker.
	out := &collectHandOff{after: cfg.RelayHandOff}
	c, err := newCore(&cfg, out)
	if err != nil {
		b.Fatal(err)
	}
	w, err := attempt.New(attempt.Config{
		Pool: pool, Subjects: wire.Subjects{Prefix: cfg.SubjectPrefix}, Definitions: cfg.Definitions, Logger: quiet, Metrics: c.Metrics(),
		Publisher: out, Mover: c, Eager: eager, Tracer: c.Tracer(),
	})
	if err != nil {
		b.Fatal(err)
	}
	cl := &Client{c: c}
	in := fixture.Input{From: 1, To: 2, Amount: 1}

	i := 0
	for b.Loop() {
		i++
		out.sent = out.sent[:0]
		if _, err := cl.Start(ctx, def, fmt.Sprintf("bench-%d", i), in); err != nil {
			b.Fatal(err)
		}
		steps := 0
		for len(out.sent) > 0 {
			row := out.sent[0]
			out.sent = out.sent[1:]
			cmd, err := wire.DecodeCommand(row.Payload)
			if err != nil {
				b.Fatalf("saga %d: the engine handed on what is not a command (%s): %v", i, row.Subject, err)
			}
			cmd.Trace = row.Headers
			if eager {
				w.Run(ctx, cmd, false, func(err error) {
					if err != nil {
						b.Fatal(err)
					}
				})
			} else if _, err := w.Handle(ctx, cmd, false); err != nil {
				b.Fatal(err)
			}
			steps++
		}
		if want := 2; eager && steps != 1 || !eager && steps != want {
			b.Fatalf("saga %d handed %d commands on, not 1 (eager) or 2 (alone)", i, steps)
		}
	}
	var credited int
	if err := shared.QueryRow(ctx, `select count(*) from idemsaga.sagas where state = $1`, fixture.StateCredited).Scan(&credited); err != nil {
		b.Fatal(err)
	}
	if credited != i {
		b.Fatalf("%d of %d sagas credited", credited, i)
	}
}

// collectHandOff keeps what transactions commit, as the engine's publish
// after commit would hand it to the broker.
type collectHandOff struct {
	after time.Duration
	sent  []outbox.Committed
}

func (h *collectHandOff) Committed(rows []outbox.Committed) { h.sent = append(h.sent, rows...) }
func (h *collectHandOff) Publish(rows ...outbox.Committed)  { h.sent = append(h.sent, rows...) }
func (h *collectHandOff) PublishAfter() any                 { return h.after.Milliseconds() }
func (h *collectHandOff) Backlog(context.Context) (maintenance.Backlog, bool) {
	return maintenance.Backlog{}, false
}
