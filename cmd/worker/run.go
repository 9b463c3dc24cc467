package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/httpapi"
)

type runCmd struct {
	NATSURL          string        `name:"nats-url" env:"NATS_URL" default:"${nats_url}" help:"NATS server with JetStream."`
	StepConcurrency  int           `name:"step-concurrency" default:"8" help:"Step commands handled at once."`
	ReplyConcurrency int           `name:"reply-concurrency" default:"4" help:"Replies applied at once."`
	MaxConns         int32         `name:"max-conns" default:"20" help:"Database connections of this process."`
	DrainTimeout     time.Duration `name:"drain-timeout" default:"30s" help:"How long SIGINT/SIGTERM waits for work in hand."`
	Migrate          bool          `help:"Apply migrations before starting."`
	AckWait          time.Duration `name:"ack-wait" default:"0s" help:"JetStream redelivery delay of unacknowledged messages (0: step timeout + 30s, at least 60s)."`
	HTTPAddr         string        `name:"http-addr" env:"HTTP_ADDR" default:"127.0.0.1:9464" help:"Address of the HTTP API (/transfers), /metrics, /healthz and /readyz; port 0 picks a free port (logged)."`
	KeepFinished     time.Duration `name:"keep-finished" default:"168h" help:"How long finished sagas and their inbox records are kept (the replay window); a key can start a new saga after it."`
	KeepPublished    time.Duration `name:"keep-published" default:"0s" help:"How long published outbox rows are kept (0: deleted as soon as the broker acknowledged them; otherwise more than the broker's 2-minute dedup window)."`
	RelayHandOff     time.Duration `name:"relay-hand-off" default:"10s" help:"How long the relay leaves an outbox row to the process that committed it, which publishes it right after the commit; past it the relay publishes what is still there (after a crash between commit and publish)."`
	NoRetention      bool          `name:"no-retention" help:"Keep everything forever (run no cleaner)."`
	MetricsFile      string        `name:"metrics-file" help:"Write the engine's counters as JSON to this file every 500ms (for harnesses that kill workers)."`
}

func (r *runCmd) Run(ctx context.Context, g *globals) error {
	log := newLogger(g.LogLevel, g.LogFormat)
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
	if err := checkExamplesMigrated(ctx, pool); err != nil {
		return err
	}
	nc, err := connectNATS(r.NATSURL, fmt.Sprintf("idemsaga-worker-%d", os.Getpid()))
	if err != nil {
		return err
	}
	defer nc.Close()
	defs, err := g.definitions()
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	e, err := engine.New(engine.Config{
		Pool: pool, NATS: nc, Definitions: defs,
		Stream: g.Stream, SubjectPrefix: g.SubjectPrefix,
		StepConcurrency: r.StepConcurrency, ReplyConcurrency: r.ReplyConcurrency,
		LeaseGrace: g.LeaseGrace, AckWait: r.AckWait, RelayHandOff: r.RelayHandOff, Logger: log, Registerer: reg,
		Retention:        engine.RetentionConfig{FinishedSagas: r.KeepFinished, PublishedOutbox: r.KeepPublished},
		DisableRetention: r.NoRetention,
	})
	if err != nil {
		return err
	}
	if r.MetricsFile != "" {
		stopMetrics := writeMetricsEvery(ctx, reg, r.MetricsFile, 500*time.Millisecond)
		defer stopMetrics()
	}
	if err := e.Start(ctx); err != nil {
		return err
	}
	api, err := httpapi.New(httpapi.Config{Pool: pool, Client: e.Client(), Definition: defs[0], Logger: log})
	if err != nil {
		_ = e.Stop(context.Background())
		return err
	}
	ops, err := newOpsServer(r.HTTPAddr, reg, e.Ready, log, route{"/transfers", api}, route{"/transfers/", api})
	if err != nil {
		_ = e.Stop(context.Background())
		return err
	}
	log.Info("worker running; SIGINT or SIGTERM drains and stops", "pid", os.Getpid(), "stream", g.Stream)
	<-ctx.Done()
	log.Info("draining")
	sctx, cancel := context.WithTimeout(context.Background(), r.DrainTimeout)
	defer cancel()
	// Stop taking HTTP requests first, so every saga an answer promised
	// is relayed by this process's final flush.
	if err := ops.Shutdown(sctx); err != nil {
		log.Warn("http server shutdown", "error", err)
	}
	if err := e.Stop(sctx); err != nil {
		return fmt.Errorf("drain: %w", err)
	}
	if err := nc.Drain(); err != nil {
		log.Warn("nats drain", "error", err)
	}
	log.Info("stopped cleanly")
	return nil
}

// writeMetricsEvery writes reg's counters to path every interval (through
// a temporary file and a rename, so readers never see half a file) until
// the returned function is called, which writes them a last time.
func writeMetricsEvery(ctx context.Context, reg *prometheus.Registry, path string, every time.Duration) func() {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			_ = writeMetrics(reg, path)
			select {
			case <-done:
				_ = writeMetrics(reg, path)
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(done); <-stopped }
}

func writeMetrics(reg *prometheus.Registry, path string) error {
	families, err := reg.Gather()
	if err != nil {
		return err
	}
	out := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			for _, lp := range m.GetLabel() {
				name += "|" + lp.GetName() + "=" + lp.GetValue()
			}
			switch {
			case m.GetCounter() != nil:
				out[name] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				out[name+"|count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
