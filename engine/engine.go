package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/internal/testhook"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/steps"
)

func newCore(cfg *Config, out orchestrate.HandOff) (*orchestrate.Core, error) {
	m, err := metrics.New(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return newCoreWith(cfg, m, out), nil
}

// newCoreWith is newCore with the metrics already registered.
func newCoreWith(cfg *Config, m *metrics.Metrics, out orchestrate.HandOff) *orchestrate.Core {
	return orchestrate.New(orchestrate.Config{
		Pool: cfg.Pool, Schema: cfg.schema(), Sealer: seal.New(cfg.Codec), Definitions: cfg.Definitions, SubjectPrefix: cfg.SubjectPrefix, LeaseGrace: cfg.LeaseGrace,
		MaxInputBytes: cfg.MaxInputBytes, MaxResultBytes: cfg.MaxResultBytes, Metrics: m, Logger: cfg.Logger, Tracer: tracing.New(cfg.TracerProvider),
		HandOff: out, OnFinished: cfg.OnFinishedFunc,
	})
}

// NewClient returns a client that starts and reads sagas without running
// any worker. It uses Pool, Definitions, SubjectPrefix, LeaseGrace and
// Registerer of cfg.
func NewClient(cfg Config) (*Client, error) {
	cfg = *cfg.WithDefaults()
	if err := cfg.withChildren(); err != nil {
		return nil, err
	}
	if err := cfg.validate(false); err != nil {
		return nil, err
	}
	c, err := newCore(&cfg, nil)
	if err != nil {
		return nil, err
	}
	return &Client{c: c, cfg: cfg}, nil
}

// Engine is one worker process's share of the work: the outbox relay, the
// step workers, the orchestrator and the reaper of due retries and expired
// leases. Any number of engines may share one database and one stream.
type Engine struct {
	// id names this engine in idemsaga.workers.
	id       uuid.UUID
	cfg      Config
	c        *orchestrate.Core
	client   *Client
	js       jetstream.JetStream
	backlog  *maintenance.StreamBacklog
	subjects wire.Subjects
	relay    *outbox.Relay
	steps    *attempt.Runner
	cleaner  *maintenance.Cleaner
	// loseChildEnds drops the ends of children instead of telling their
	// parents (testhook.Hooks.LoseChildEnds).
	loseChildEnds atomic.Bool
	// stepRunner runs the step workers, runner the orchestrator and the
	// reaper: Stop drains the steps first.
	stepRunner lifecycle.Runner
	runner     lifecycle.Runner
	// trig starts the sagas of schedules and events.
	trig triggers

	// dup runs the copies of commands the test kit delivers (dups),
	// dupsInHand how many of them run.
	dup        *attempt.Runner
	dups       sync.WaitGroup
	dupsInHand atomic.Int64

	mu sync.Mutex
	// run is the current run (Start to the end of its stop), nil while
	// the engine is stopped.
	run *run
	// stopped is closed once the last run has stopped (Stopped).
	stopped chan struct{}
}

// run is one run of an engine, from Start to the end of its stop.
type run struct {
	// cancelWork cancels the work in hand (StopAndCancel, or the end of
	// Start's context).
	cancelWork context.CancelFunc
	// unwatch stops watching Start's context.
	unwatch func() bool
	// stopOnce begins the stop once; done is closed when it ended.
	stopOnce sync.Once
	done     chan struct{}
	// err is what the stop's parts reported, set before done closes.
	err error
}

// closedChan is what Stopped returns for an engine that never ran.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// New returns an engine; Start runs it.
func New(cfg Config) (*Engine, error) {
	cfg = *cfg.WithDefaults()
	if err := cfg.withChildren(); err != nil {
		return nil, err
	}
	if err := cfg.validate(true); err != nil {
		return nil, err
	}
	e := &Engine{id: uuid.New(), cfg: cfg, subjects: wire.Subjects{Prefix: cfg.SubjectPrefix}}
	var err error
	e.js, err = jetstream.New(cfg.NATS,
		jetstream.WithPublishAsyncMaxPending(4096),
		jetstream.WithPublishAsyncTimeout(outbox.PublishTimeoutDefault))
	if err != nil {
		return nil, fmt.Errorf("idemsaga: JetStream: %w", err)
	}
	var consumers []string
	for _, base := range []string{commandsConsumer, repliesConsumer} {
		for _, c := range broker.DefinitionConsumers(cfg.Stream+base, e.definitionNames(), func(string) string { return "" }) {
			consumers = append(consumers, c.Durable)
		}
	}
	e.backlog = maintenance.NewStreamBacklog(e.js, cfg.Stream, consumers...)
	m, err := metrics.New(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	e.relay, err = outbox.NewRelay(outbox.RelayConfig{
		Pool: cfg.Pool, Schema: cfg.Schema, JetStream: e.js, BatchSize: cfg.RelayBatch, PollInterval: cfg.RelayPollInterval,
		KeepPublished: cfg.Retention.PublishedOutbox != 0, Logger: cfg.Logger,
		OnPublishFunc: func(rows, dups int, took time.Duration) {
			m.OutboxPublished.Add(float64(rows))
			m.Deliveries.WithLabelValues(metrics.LayerBroker).Add(float64(rows))
			m.Duplicates.WithLabelValues(metrics.LayerBroker).Add(float64(dups))
			m.RelayBatchSeconds.Observe(took.Seconds())
		},
		RecoverFunc:    func(ctx context.Context) error { _, err := e.stream(ctx); return err },
		TracerProvider: cfg.TracerProvider,
	})
	if err != nil {
		return nil, err
	}
	// What this process commits it runs or publishes itself, right after
	// the commit; the relay sweeps only what that missed.
	out := &engineHandOff{relay: e.relay, after: cfg.RelayHandOff, backlog: e.backlog}
	c := newCoreWith(&cfg, m, out)
	e.c, e.client = c, &Client{c: c, cfg: cfg}
	if err := e.newTriggers(m); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		for _, col := range []struct {
			what string
			c    prometheus.Collector
		}{
			{"the outbox backlog", maintenance.NewBacklogCollector(cfg.Pool, c.Schema())},
			{"the paused sagas", maintenance.NewPausedCollector(cfg.Pool, c.Schema())},
			{"the dead-letter", maintenance.NewDeadLetterCollector(cfg.Pool, c.Schema())},
			{"the stream backlog", maintenance.NewStreamCollector(e.js, cfg.Stream, e.backlog)},
			{"the stream's drain", maintenance.NewDrainCollector(e.backlog)},
		} {
			if err := cfg.Registerer.Register(col.c); err != nil {
				return nil, fmt.Errorf("idemsaga: register %s metric: %w", col.what, err)
			}
		}
	}
	if cfg.Retention.cleans() {
		e.cleaner = maintenance.NewCleaner(cfg.Pool, cfg.Retention.cleaner(e.client), cfg.Logger)
	}
	// The engine's own step workers share its database: an outcome moves
	// its saga on in the step's own transaction.
	acfg := attempt.Config{
		Pool: cfg.Pool, Schema: c.Schema(), Definitions: cfg.Definitions, Subjects: e.subjects, Logger: cfg.Logger, Metrics: m, MaxResultBytes: cfg.MaxResultBytes,
		Sealer:    c.Sealer(),
		Publisher: out, Recent: steps.RecentDefault, Mover: c, Eager: true, LeaseGrace: cfg.LeaseGrace,
		Slots: cfg.StepConcurrency, DeadLetters: cfg.deadLetters, Tracer: c.Tracer(),
		Children: children{cl: e.client},
	}
	e.steps, err = attempt.New(acfg)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: %w", err)
	}
	out.steps = e.steps
	e.client.steps = e.steps
	return e, nil
}

// arm gives a run the test kit's hooks (package testhook), before its
// step workers start.
func (e *Engine) arm(h *testhook.Hooks) {
	e.loseChildEnds.Store(h != nil && h.LoseChildEnds)
	if h == nil {
		e.steps.Arm(nil)
		return
	}
	if h.Faults != nil && e.dup == nil {
		// A copy the kit delivers goes to a runner that shares no memory
		// with the first, as a delivery to another worker would.
		if dup, err := e.steps.Twin(); err == nil {
			e.dup = dup
		} else {
			e.cfg.Logger.Error("test kit: no runner for the copies DeliverTwice delivers; they run on the engine's own", "error", err)
			e.dup = e.steps
		}
	}
	if h.Faults != nil {
		h.Faults.Duplicate = func(cmd wire.Command) {
			e.dupsInHand.Add(1)
			e.dups.Go(func() {
				defer e.dupsInHand.Add(-1)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				_, _ = e.dup.Handle(ctx, cmd, false)
			})
		}
	}
	e.steps.Arm(h.Faults)
	h.InHand = func() int { return e.steps.InHand() + int(e.dupsInHand.Load()) }
}

// Client returns a client whose starts wake this engine's relay at once.
func (e *Engine) Client() *Client { return e.client }

// applyReply records one reply, as the orchestrator does for every reply
// it consumes.
func (e *Engine) applyReply(ctx context.Context, r wire.Reply) (orchestrate.Verdict, error) {
	return e.c.ApplyReply(ctx, r)
}

// handleCommand runs one step command as the engine's step workers do: an
// outcome moves the saga on in the step's own transaction when it can,
// anything else is answered with a reply in the outbox.
func (e *Engine) handleCommand(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return e.steps.Handle(ctx, cmd, false)
}

// reapOnce runs one pass of the reaper.
func (e *Engine) reapOnce(ctx context.Context) (int, error) {
	return e.c.ReapOnce(ctx, ReapBatchDefault)
}

// childLoop tells parents the ends of the children this process moved
// to their end, right after each commit (the reaper's sweep tells those
// it missed).
func (e *Engine) childLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-e.c.ChildEnds():
			if e.loseChildEnds.Load() {
				continue
			}
			if err := e.c.ChildEnded(context.WithoutCancel(ctx), id); err != nil {
				e.cfg.Logger.Warn("engine: could not tell a child's end to its parent; the reaper's sweep will", "saga_id", id, "error", err)
			}
		}
	}
}

// Start checks the database (reachable, migrated) and the broker, creates
// the stream and durable consumers if missing, and runs everything in the
// background until Stop, StopAndCancel, or the end of ctx (which stops as
// StopAndCancel does: pass context.WithoutCancel(ctx) to keep the engine
// running past it). It returns once the engine takes work. A stopped
// engine can be started again.
func (e *Engine) Start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.run != nil {
		return errors.New("idemsaga: engine already started (or still stopping): call Stop, and wait for Stopped, before starting it again")
	}
	if err := e.cfg.Pool.Ping(ctx); err != nil {
		return fmt.Errorf("idemsaga: database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	if err := checkMigrated(ctx, e.cfg.Pool, e.cfg.Schema); err != nil {
		return err
	}
	if err := checkDeployment(ctx, e.c, &e.cfg, true); err != nil {
		return err
	}
	e.client.markChecked()
	if e.cfg.NATS.Opts.MaxReconnect >= 0 {
		e.cfg.Logger.Warn("the NATS connection stops reconnecting after a while; connect with nats.MaxReconnects(-1) so the engine survives long broker outages",
			"max_reconnects", e.cfg.NATS.Opts.MaxReconnect)
	}
	// Fail fast when the broker cannot host the stream and consumers.
	replies, commands := e.replyConsumers(), e.commandConsumers()
	for _, c := range append(slices.Clip(replies), commands...) {
		if _, err := c(ctx); err != nil {
			return err
		}
	}
	// The work in hand (handlers, replies being applied) runs under work:
	// a graceful stop lets it finish, a hard one cancels it.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	r := &run{cancelWork: cancelWork, done: make(chan struct{})}
	e.run, e.stopped = r, make(chan struct{})
	fail := func(err error) error {
		e.mu.Unlock()
		_ = e.StopAndCancel(context.Background())
		e.mu.Lock()
		return err
	}
	e.arm(testhook.From(ctx))
	if err := e.relay.Start(work); err != nil {
		return fail(err)
	}
	if e.cleaner != nil {
		if err := e.cleaner.Start(work); err != nil {
			return fail(err)
		}
	}
	if err := e.stepRunner.Start(work, func(ctx context.Context) {
		// The runner's slots bound the commands of every definition
		// handled at once.
		broker.Pools(ctx, work, e.cfg.Logger, commands, e.cfg.StepConcurrency, e.steps.HandleMsg)
	}, func(ctx context.Context) {
		// Commands this process commits run here at once when a slot is
		// free, rather than through the broker.
		e.steps.Serve(ctx, work)
	}); err != nil {
		return fail(err)
	}
	// Starts that return after Start are run here from the first one.
	select {
	case <-e.steps.Serving():
	case <-ctx.Done():
		return fail(fmt.Errorf("idemsaga: start: %w", ctx.Err()))
	}
	// Recorded as a worker of its versions before Start returns; parked
	// commands of those versions go out again now.
	e.beat(ctx)
	if err := e.runner.Start(work,
		func(ctx context.Context) {
			// ReplyConcurrency bounds the replies of every definition
			// applied at once.
			slots := make(chan struct{}, e.cfg.ReplyConcurrency)
			broker.Pools(ctx, work, e.cfg.Logger, replies, e.cfg.ReplyConcurrency, func(ctx context.Context, msg jetstream.Msg) {
				slots <- struct{}{}
				defer func() { <-slots }()
				e.c.HandleReplyMsg(ctx, msg)
			})
		},
		e.reapLoop,
		e.childLoop,
		e.heartbeat,
		e.watchFailovers,
		e.reconcileLoop,
	); err != nil {
		return fail(err)
	}
	if err := e.startTriggers(ctx, work); err != nil {
		return fail(err)
	}
	r.unwatch = context.AfterFunc(ctx, func() {
		e.cfg.Logger.Info("engine: the context Start was given ended; stopping and cancelling the work in hand")
		_ = e.StopAndCancel(context.Background())
	})
	return nil
}

func (e *Engine) reapLoop(ctx context.Context) {
	t := time.NewTicker(e.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for {
			n, err := e.reapOnce(context.WithoutCancel(ctx))
			if err != nil {
				e.cfg.Logger.Warn("reaper: pass failed; will retry", "error", err)
			}
			if n < ReapBatchDefault || ctx.Err() != nil {
				break
			}
		}
	}
}

// Stop drains and stops: consumers stop fetching and finish the messages
// in hand, then the reaper stops, then the relay publishes what was
// committed and stops. If ctx ends first, Stop returns its error while the
// drain goes on (Stopped says when it ends; StopAndCancel cancels the work
// in hand). Calling Stop again, or on an engine not running, is fine.
func (e *Engine) Stop(ctx context.Context) error {
	return e.stop(ctx, false)
}

// StopAndCancel stops as Stop does, and first cancels the work in hand:
// the contexts of running handlers end, and each attempt records what it
// knows (an external call cut short is unknown, and runs again under its
// key). It still waits for the handlers to return; if ctx ends first, it
// returns its error while the stop goes on.
func (e *Engine) StopAndCancel(ctx context.Context) error {
	return e.stop(ctx, true)
}

// Stopped returns a channel closed once the engine has stopped: at once
// for an engine not running, or once the stop of the running one ended,
// whatever the contexts given to Stop.
func (e *Engine) Stopped() <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stopped == nil {
		return closedChan
	}
	return e.stopped
}

func (e *Engine) stop(ctx context.Context, cancel bool) error {
	e.mu.Lock()
	r := e.run
	e.mu.Unlock()
	if r == nil {
		return nil
	}
	if cancel {
		r.cancelWork()
	}
	r.stopOnce.Do(func() { go e.stopRun(r) })
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("idemsaga: stop did not finish in time; the engine goes on draining (Stopped says when it ends; StopAndCancel cancels the work in hand): %w", ctx.Err())
	}
}

// stopRun stops run r to its end, then marks the engine stopped.
func (e *Engine) stopRun(r *run) {
	if r.unwatch != nil {
		r.unwatch()
	}
	ctx := context.Background()
	errs := e.stopTriggers(ctx)
	if e.cleaner != nil {
		errs = append(errs, e.cleaner.Stop(ctx))
	}
	e.steps.Drain()
	errs = append(errs, e.stepRunner.Stop(ctx))
	errs = append(errs, e.runner.Stop(ctx))
	if e.relay.Running() {
		if _, err := e.relay.RelayOnce(ctx); err != nil {
			e.cfg.Logger.Warn("relay: final flush failed; rows stay in the outbox for the next relay", "error", err)
		}
	}
	e.dups.Wait()
	errs = append(errs, e.relay.Stop(ctx))
	r.cancelWork()
	// Each part that failed alike says so once.
	seen := map[string]bool{}
	var distinct []error
	for _, err := range errs {
		if err != nil && !seen[err.Error()] {
			seen[err.Error()] = true
			distinct = append(distinct, err)
		}
	}
	r.err = errors.Join(distinct...)
	e.mu.Lock()
	e.run = nil
	close(e.stopped)
	e.mu.Unlock()
	close(r.done)
}

// checkMigrated fails when the database's schema is not this build's.
func checkMigrated(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: database unreachable: %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.CheckSchema(ctx, conn.Conn(), schema); err != nil {
		return fmt.Errorf("idemsaga: %w", err)
	}
	return nil
}
