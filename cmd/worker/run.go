package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

type runCmd struct {
	NATSURL          string        `name:"nats-url" env:"NATS_URL" default:"${nats_url}" help:"NATS server with JetStream."`
	StepConcurrency  int           `name:"step-concurrency" default:"8" help:"Step commands handled at once."`
	ReplyConcurrency int           `name:"reply-concurrency" default:"4" help:"Replies applied at once."`
	LeaseGrace       time.Duration `name:"lease-grace" default:"30s" help:"Added to a step's timeout to make its lease."`
	MaxConns         int32         `name:"max-conns" default:"20" help:"Database connections of this process."`
	DrainTimeout     time.Duration `name:"drain-timeout" default:"30s" help:"How long SIGINT/SIGTERM waits for work in hand."`
	Migrate          bool          `help:"Apply migrations before starting."`
}

func (r *runCmd) Run(ctx context.Context, g *globals) error {
	log := newLogger(g.LogLevel)
	pool, err := openDB(ctx, g.DatabaseURL, r.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	if r.Migrate {
		if err := migrateAll(ctx, pool); err != nil {
			return err
		}
	}
	nc, err := connectNATS(r.NATSURL, fmt.Sprintf("idemsaga-worker-%d", os.Getpid()))
	if err != nil {
		return err
	}
	defer nc.Close()
	e, err := engine.New(engine.Config{
		Pool: pool, NATS: nc, Definitions: []*saga.Definition{transfer.Definition},
		Stream: g.Stream, SubjectPrefix: g.SubjectPrefix,
		StepConcurrency: r.StepConcurrency, ReplyConcurrency: r.ReplyConcurrency,
		LeaseGrace: r.LeaseGrace, Logger: log,
	})
	if err != nil {
		return err
	}
	if err := e.Start(ctx); err != nil {
		return err
	}
	log.Info("worker running; SIGINT or SIGTERM drains and stops", "pid", os.Getpid(), "stream", g.Stream)
	<-ctx.Done()
	log.Info("draining")
	sctx, cancel := context.WithTimeout(context.Background(), r.DrainTimeout)
	defer cancel()
	if err := e.Stop(sctx); err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	if err := nc.Drain(); err != nil {
		log.Warn("nats drain", "error", err)
	}
	log.Info("stopped cleanly")
	return nil
}
