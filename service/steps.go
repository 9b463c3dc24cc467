package service

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/idemsaga/idemsaga/steps"
)

// stepsCmd runs a process of step workers only (package steps): it takes
// step commands from the stream's shared consumer, runs their attempts and
// answers each with a reply in the outbox. The engines (`run`) relay those
// replies and move the sagas: a deployment can scale its steps apart from
// its orchestration.
type stepsCmd struct {
	Concurrency  int           `name:"step-concurrency" default:"8" help:"Step commands handled at once."`
	MaxConns     int32         `name:"max-conns" default:"20" help:"Database connections of this process."`
	DrainTimeout time.Duration `name:"drain-timeout" default:"30s" help:"How long SIGINT/SIGTERM waits for the attempts in hand."`
	AckWait      time.Duration `name:"ack-wait" default:"0s" help:"JetStream redelivery delay of unacknowledged commands; give the engines' --ack-wait (0: the longest step timeout + 30s, at least 60s)."`
}

func (s *stepsCmd) Run(ctx context.Context, f *Flags) error {
	log := f.Logger()
	if len(f.defs) == 0 {
		return fmt.Errorf("%s has no saga definitions to run: give service.Config its Definitions (this binary can start, show and repair sagas, not run their steps)", name(*f.cfg))
	}
	pool, err := f.OpenDB(ctx, s.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := f.checkMigrated(ctx, pool); err != nil {
		return err
	}
	nc, err := f.ConnectNATS(hostPID(name(*f.cfg)))
	if err != nil {
		return err
	}
	defer nc.Close()
	tp, err := newTracerProvider(ctx, name(*f.cfg), log)
	if err != nil {
		return err
	}
	cfg := steps.Config{Pool: pool, NATS: nc, Schema: f.Schema, Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, AckWait: s.AckWait,
		Definitions: f.defs, Concurrency: s.Concurrency, Logger: log}
	if tp != nil {
		cfg.TracerProvider = tp
	}
	// After the worker's drain.
	defer shutdownTracing(tp, log)
	w, err := steps.New(cfg)
	if err != nil {
		return err
	}
	// The signal that ends ctx drains the worker (below).
	if err := w.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	log.Info("step worker running (steps only: the engines of `run` move the sagas); SIGINT or SIGTERM drains and stops",
		"pid", os.Getpid(), "stream", f.Stream, "definitions", len(f.defs))
	<-ctx.Done()
	log.Info("draining")
	sctx, cancel := context.WithTimeout(context.Background(), s.DrainTimeout)
	defer cancel()
	if err := w.Stop(sctx); err != nil {
		return fmt.Errorf("drain: attempts still in hand after --drain-timeout %s (their leases bring them back): %w", s.DrainTimeout, err)
	}
	if err := nc.Drain(); err != nil {
		log.Warn("nats drain", "error", err)
	}
	log.Info("stopped cleanly")
	return nil
}
