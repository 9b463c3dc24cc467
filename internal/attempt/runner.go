package attempt

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/limit"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Outcome is how one attempt ended, as a Mover is asked to apply it.
type Outcome struct {
	// Status is succeeded, failed (for good), retry (known not to have
	// taken effect) or unknown (an external attempt that may have).
	Status wire.Outcome
	Result json.RawMessage
	Error  string
}

// Mover applies an attempt's outcome to its saga in the attempt's own
// transaction: the engine, when it runs the step workers on its own
// database.
type Mover interface {
	// Move returns the move that applies o, the outcome of cmd's attempt
	// of a step of the given kind, to cmd's saga as it was when cmd was
	// store.Recorded (cmd.State, cmd.Version). ok is false when o is not applied
	// in the step (a retry with attempts left, an external step's outcome
	// other than a success, a command that carries no version): a reply
	// then carries it to the orchestrator. If the saga moved since cmd was
	// store.Recorded, the move misses and the reply is store.Recorded instead.
	Move(cmd wire.Command, kind saga.StepKind, o Outcome) (m store.Move, ok bool)
	// Moved is called once a move applied in a step has committed, with
	// when its saga started.
	Moved(m *store.Move, created time.Time)
}

// Publisher publishes outbox rows right after the transaction that wrote
// them committed (outbox.Relay.Publish, behind the engine's hand-off).
type Publisher interface {
	Publish(rows ...outbox.Committed)
	// PublishAfter is the publish_after of the rows an attempt writes, in
	// milliseconds: when the relay's sweep takes a row over. nil makes
	// the rows the relay's at once (this process does not publish).
	PublishAfter() any
}

// Config configures a Runner.
type Config struct {
	// Pool is the engine's database: the inbox, the outbox, the sagas and
	// the business tables of database steps. Required.
	Pool *pgxpool.Pool
	// Schema is the deployment's schema; nil for pgschema.SchemaDefault.
	Schema *pgschema.Schema
	// MaxResultBytes, if positive, bounds a handler's result: one over it
	// fails the attempt (engine.Config.MaxResultBytes).
	MaxResultBytes int
	// Sealer opens the input and results a handler reads, and seals the
	// results it returns (engine.Config.Codec). Nil: none.
	Sealer *seal.Sealer
	// Definitions the runner can run. Required.
	Definitions []*saga.Definition
	// Subjects names reply subjects. Required.
	Subjects wire.Subjects
	Logger   *slog.Logger
	Metrics  *metrics.Metrics
	// Publisher, if set, publishes the outbox rows an attempt committed,
	// right after its commit; the relay takes a row over after its
	// hand-off. Without it, rows are the relay's at once.
	Publisher Publisher
	// Recent is how many answered attempts are remembered in memory
	// (0: none).
	Recent int
	// Mover, if set, applies outcomes in the attempt's own transaction;
	// without it every outcome is answered with a reply.
	Mover Mover
	// Slots, if positive, bounds the commands handled at once, delivered
	// (HandleMsg) or offered (Offer); without it Offer takes none.
	Slots int
	// Eager runs here, at once, the step that an attempt's move dispatched,
	// instead of publishing its command (needs Mover and Publisher). The
	// command's outbox row stays until the transaction that records that
	// step's outcome deletes it; a crash before leaves it to the relay's
	// sweep, after the hand-off.
	Eager bool
	// DeadLetters bounds the deliveries of a command the runner cannot
	// run (its definition, version or step unknown here) before it is
	// parked. Zero fields take the defaults.
	DeadLetters DeadLetterPolicy
	// Tracer, if set, records a span for each attempt, a child of the
	// trace context its command arrived with, and gives that span's
	// context to the reply and the next command it writes.
	Tracer *tracing.Tracer
	// LeaseGrace, if positive, is the engine's: a command delivered late
	// or again restarts its step's lease at delivery (claimLease).
	LeaseGrace time.Duration
	// Children runs the phases of child steps (saga.ChildStep); without
	// it, their attempts fail.
	Children Children
}

// Runner runs attempts of step commands: the step side of the engine.
type Runner struct {
	cfg Config
	// defs are the runner's definitions by saga.Ref (name@version);
	// names the versions it runs of each name.
	defs   map[string]*saga.Definition
	names  map[string][]int
	dead   DeadLetterPolicy
	recent *recent
	// draining stops eager runs: their commands go to the broker.
	draining atomic.Bool
	// slots bound the commands handled at once (Config.Slots): deliveries
	// wait for one, offered commands take a free one or go to the broker.
	slots     chan struct{}
	cmdPrefix string
	serveMu   sync.RWMutex
	// servingCh is closed once Serve runs (Serving).
	servingCh   chan struct{}
	servingOnce sync.Once
	serving     bool
	work        context.Context
	offers      sync.WaitGroup
	// inHand counts the commands the runner holds (InHand).
	inHand atomic.Int64
	// faults, if set, are the test kit's (Arm).
	faults *Faults
	// gate takes the turns of steps under a limit.
	gate *limit.Gate
}

// Arm sets the test kit's faults for the runner's next run (nil for none);
// it must be called before the runner takes work.
func (r *Runner) Arm(f *Faults) { r.faults = f }

// New returns a runner.
func New(cfg Config) (*Runner, error) {
	if cfg.Pool == nil || cfg.Subjects.Prefix == "" || len(cfg.Definitions) == 0 || cfg.Logger == nil || cfg.Metrics == nil {
		return nil, errors.New("attempt: Config.Pool, Subjects, Definitions, Logger and Metrics are required")
	}
	r := &Runner{cfg: cfg, defs: make(map[string]*saga.Definition, len(cfg.Definitions)), servingCh: make(chan struct{}),
		cmdPrefix: strings.TrimSuffix(cfg.Subjects.AllCommands(), ">")}
	if cfg.Slots > 0 {
		r.slots = make(chan struct{}, cfg.Slots)
	}
	if err := limit.Check(cfg.Definitions); err != nil {
		return nil, err
	}
	r.gate = limit.New(cfg.Pool, cfg.Schema, cfg.Metrics)
	r.names = map[string][]int{}
	for _, d := range cfg.Definitions {
		if _, dup := r.defs[d.Ref()]; dup {
			return nil, fmt.Errorf("definition %s is given twice", d.Ref())
		}
		r.defs[d.Ref()] = d
		r.names[d.Name()] = append(r.names[d.Name()], d.Version())
	}
	r.dead = cfg.DeadLetters.withDefaults()
	if cfg.Recent > 0 {
		var err error
		if r.recent, err = newRecent(cfg.Recent); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// Plan is how one attempt runs, chosen once from the step and how its
// command arrived. Each field names a round trip, or what goes into one.
type Plan struct {
	// Kind is the step's: a database step runs its handler in the
	// transaction of its claim; an external step claims and records in
	// transactions of their own, and calls without one.
	Kind saga.StepKind
	// ReadFirst reads the inbox before claiming: the command was
	// delivered before, most often after a commit whose ack was lost, and
	// a plain read answers such a duplicate.
	ReadFirst bool
	// InStep applies the outcome to the saga in the attempt's own
	// transaction (Config.Mover); otherwise a reply carries it.
	InStep bool
}

// attempt is one attempt in progress.
type attempt struct {
	r       *Runner
	cmd     wire.Command
	def     *saga.Definition
	step    saga.Step
	handler saga.HandlerFunc
	policy  saga.RetryPolicy
	plan    Plan
	// first is the step's row while the start that carried the attempt
	// left it unwritten (preclaim.first); firstQueued is set once a write
	// of the attempt queued it.
	first       *store.FirstStep
	firstQueued bool

	// What the attempt leaves to do after its commit.
	sent  []outbox.Committed
	after func()
	// stored is set when the inbox holds this attempt's final outcome, or
	// a database step attempt's end (retry).
	stored bool
	// conflict is set when the claim met the key's row.
	conflict bool
	// dropped is set when the attempt wrote nothing and answers nothing:
	// a duplicate of a call in flight, a saga gone, an attempt given up.
	dropped bool
	// unknown is set when an external attempt's outcome is unknown.
	unknown bool

	// row is the outbox row of the attempt's own command when it runs
	// eagerly: the transaction that records the attempt's outcome deletes
	// it (queued, then consumed once that transaction committed).
	row              int64
	queued, consumed bool
	// next is the command the attempt's move dispatched, to run eagerly,
	// and pre its claim if it went with the move's COMMIT.
	next *outbox.Committed
	pre  *preclaim
	// given is this attempt's own claim, if it came with the COMMIT of
	// the attempt that dispatched it; the attempt takes it (nil).
	given *preclaim

	// trace is the trace context of the attempt's span, for the headers
	// of the rows it writes; nil when tracing is off.
	trace map[string]string

	// turn is the attempt's turn under its step's limit, nil for none;
	// stretch its time, which its handler's heartbeat pushes.
	turn *limit.Turn
	// stretch is read by a heartbeat, which may run on a goroutine of
	// the handler's.
	stretch atomic.Pointer[stretch]
	// progress tells the broker the command is still in hand.
	progress func()
	// doubt: the claim found an earlier attempt's outcome unknown.
	// verified: the step's Verify ran; verifiedNotDone: it answered that
	// the key took no effect.
	doubt, verified, verifiedNotDone bool

	// conn is a database step's connection while the attempt holds it.
	conn *pgxpool.Conn
	// once is set for an attempt run alone (Handle), never eagerly.
	once bool
}

// Handle runs one command to a committed outcome and returns its reply:
// the one store.Recorded, or, for a command answered from the inbox, the stored
// outcome (Duplicate set). redelivered says the transport delivered the
// command before (JetStream's NumDelivered above 1). An error means
// nothing was committed and the command should be delivered again.
func (r *Runner) Handle(ctx context.Context, cmd wire.Command, redelivered bool) (wire.Reply, error) {
	r.inHand.Add(1)
	defer r.inHand.Add(-1)
	reply, _, err := r.run(ctx, cmd, redelivered, 0, nil, true)
	return reply, err
}

// InHand returns how many commands the runner holds: delivered and not yet
// answered (waiting for a slot included), run at once with the steps they
// lead to, or run by hand.
func (r *Runner) InHand() int { return int(r.inHand.Load()) }

// Serving is closed once Serve takes offers.
func (r *Runner) Serving() <-chan struct{} { return r.servingCh }

// Drain makes the runner publish the commands it would run eagerly: it is
// stopping.
func (r *Runner) Drain() { r.draining.Store(true) }

// Offer runs at once, on a goroutine of its own, a command whose outbox
// row committed, if one of the runner's slots is free (Config.Slots); the
// attempt that records its outcome deletes the row. It returns false, and
// the caller publishes the row, when no slot is free, the runner is not
// serving or drains, or c is not a command.
func (r *Runner) Offer(c outbox.Committed) bool {
	if r.slots == nil || c.ID == 0 || !strings.HasPrefix(c.Subject, r.cmdPrefix) {
		return false
	}
	r.serveMu.RLock()
	defer r.serveMu.RUnlock()
	if !r.serving || r.draining.Load() {
		return false
	}
	select {
	case r.slots <- struct{}{}:
	default:
		return false
	}
	r.inHand.Add(1)
	r.offers.Go(func() {
		defer r.inHand.Add(-1)
		defer func() { <-r.slots }()
		r.runEager(r.work, &c, nil)
	})
	return true
}

// Serve takes offered commands (Offer) until ctx ends, then waits for
// those in hand; they run under work, which outlives ctx (cancelling it
// cancels them). A runner that drained serves again.
func (r *Runner) Serve(ctx, work context.Context) {
	r.serveMu.Lock()
	r.serving, r.work = true, work
	r.draining.Store(false)
	r.serveMu.Unlock()
	r.servingOnce.Do(func() { close(r.servingCh) })
	<-ctx.Done()
	r.serveMu.Lock()
	r.serving = false
	r.serveMu.Unlock()
	r.offers.Wait()
}

func (r *Runner) publish(rows ...outbox.Committed) {
	if r.cfg.Publisher != nil {
		r.cfg.Publisher.Publish(rows...)
	}
}

// runEager runs, one after another, the steps the attempts' moves
// dispatch, starting with next, until a saga ends, a step is not applied
// in its transaction, or the runner drains. A command not consumed by its
// attempt (an error: nothing committed) goes to the broker.
func (r *Runner) runEager(ctx context.Context, next *outbox.Committed, pre *preclaim) {
	for next != nil {
		row := *next
		if r.draining.Load() {
			pre.close(ctx)
			r.handToBroker(ctx, row)
			return
		}
		cmd, err := wire.DecodeCommand(row.Payload)
		if err != nil {
			pre.close(ctx)
			r.handToBroker(ctx, row) // cannot happen: this process wrote it
			return
		}
		cmd.Trace = row.Headers
		_, a, err := r.handle(ctx, cmd, false, row.ID, pre)
		if err != nil || row.ID != 0 && !a.consumed {
			if err != nil {
				r.cfg.Logger.Debug("step worker: a step run at once failed; its command goes to the broker", "saga_id", cmd.SagaID, "step", cmd.Step, "error", err)
			}
			r.handToBroker(ctx, row)
		}
		if err != nil {
			if a != nil {
				a.pre.close(ctx)
			}
			return
		}
		next, pre = a.next, a.pre
	}
}

// handle runs cmd; given, if not nil, is cmd's claim, sent with the COMMIT
// of the attempt whose move dispatched it, and is closed here unless the
// attempt takes it.
func (r *Runner) handle(ctx context.Context, cmd wire.Command, redelivered bool, row int64, given *preclaim) (wire.Reply, *attempt, error) {
	return r.run(ctx, cmd, redelivered, row, given, false)
}

// run is handle; once runs the attempt alone: the step its move
// dispatches goes to the broker, as its outbox row.
func (r *Runner) run(ctx context.Context, cmd wire.Command, redelivered bool, row int64, given *preclaim, once bool) (wire.Reply, *attempt, error) {
	if !r.cfg.Tracer.Enabled() {
		return r.runAttempt(ctx, cmd, redelivered, row, given, once, nil)
	}
	ctx, sp := r.cfg.Tracer.StartAttempt(ctx, cmd.Trace, tracing.Attempt{
		Saga: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step, Phase: string(cmd.Phase), Attempt: cmd.Attempt})
	reply, a, err := r.runAttempt(ctx, cmd, redelivered, row, given, once, r.cfg.Tracer.Headers(ctx))
	outcome := string(reply.Outcome)
	switch {
	case err != nil:
		outcome = "error"
	case reply.Duplicate || a != nil && a.dropped:
		outcome = "duplicate"
	case a != nil && a.unknown:
		outcome = "unknown"
	}
	recorded := err
	if err == nil && reply.Error != "" {
		recorded = errors.New(reply.Error) // the handler's error, on the span only
	}
	sp.SetAttributes(tracing.AttrDuplicate.Bool(reply.Duplicate), attribute.Bool("idemsaga.redelivered", redelivered))
	sp.End(outcome, recorded)
	return reply, a, err
}

// runAttempt is run; trace is the trace context of the attempt's span.
func (r *Runner) runAttempt(ctx context.Context, cmd wire.Command, redelivered bool, row int64, given *preclaim, once bool, trace map[string]string) (wire.Reply, *attempt, error) {
	defer func() { given.close(ctx) }()
	def, idx, err := r.lookup(cmd)
	if err != nil {
		return wire.Reply{}, nil, err
	}
	step := def.Step(idx)
	if step.Kind == saga.ChildStep {
		step = r.childHandlers(def, idx, step)
	}
	if r.faults.take(DeliverTwice, cmd) && r.faults.Duplicate != nil {
		r.faults.Duplicate(cmd)
	}
	if given != nil && (step.Kind != saga.DatabaseStep || given.key != cmd.Key || given.attempt != cmd.Attempt) {
		given.close(ctx) // not this attempt's: let its key go before anything waits
		given = nil
	}
	a := &attempt{r: r, cmd: cmd, def: def, step: step, handler: step.Forward, policy: step.Retry, row: row, given: given, once: once,
		plan: Plan{Kind: step.Kind, ReadFirst: redelivered, InStep: r.cfg.Mover != nil}, trace: trace, progress: progressOf(ctx)}
	if cmd.Phase == saga.PhaseCompensate {
		a.handler, a.policy = step.Compensate, step.CompensateRetry
	}

	// The wait is bounded as the attempt is: a run that hangs must not
	// gather its copies here, each holding a slot of the worker.
	waitCtx, cancelWait := context.WithTimeout(ctx, a.policy.Timeout)
	ans, ok, release, err := r.await(waitCtx, cmd)
	cancelWait()
	if err != nil {
		return wire.Reply{}, a, fmt.Errorf("another delivery of this attempt is still running in this worker: %w", err)
	}
	m := r.cfg.Metrics
	if ok {
		// Another delivery of an attempt this worker answered: the inbox
		// holds its outcome, and its reply or move committed with it.
		m.Deliveries.WithLabelValues(metrics.LayerInbox).Inc()
		m.Duplicates.WithLabelValues(metrics.LayerRecent).Inc()
		m.StepAttempts.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase), "duplicate").Inc()
		reply := a.replyBase()
		reply.Outcome, reply.Result, reply.Error, reply.Duplicate = ans.outcome, bytes.Clone(ans.result), ans.errText, true
		return reply, a, nil
	}
	defer release()
	start := time.Now()
	var reply wire.Reply
	if a.plan.Kind != saga.DatabaseStep {
		reply, err = a.external(ctx)
	} else {
		reply, err = a.database(ctx)
	}
	if err != nil {
		return reply, a, err
	}
	if !reply.Duplicate && !a.dropped && (r.faults.take(CrashAfterCommit, cmd) ||
		a.plan.Kind == saga.DatabaseStep && r.faults.take(LoseOutcome, cmd)) {
		a.pre.close(ctx)
		a.next, a.pre = nil, nil
		return reply, a, ErrCrashed
	}
	// The attempt is counted before the move it committed is reported,
	// so a saga counted finished has its attempts counted.
	m.Deliveries.WithLabelValues(metrics.LayerInbox).Inc()
	outcome := string(reply.Outcome)
	switch {
	case reply.Duplicate || a.dropped:
		if a.conflict {
			m.UniqueConflicts.WithLabelValues("inbox").Inc()
		}
		outcome = "duplicate"
		m.Duplicates.WithLabelValues(metrics.LayerInbox).Inc()
	case a.unknown:
		outcome = "unknown"
	}
	m.StepAttempts.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase), outcome).Inc()
	m.StepHandler.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase)).Observe(time.Since(start).Seconds())
	if a.after != nil {
		a.after()
	}
	r.remember(cmd, reply, a.stored)
	r.publish(a.sent...)
	if cmd.Phase == saga.PhaseCompensate && reply.Outcome == wire.OutcomeSucceeded && !reply.Duplicate {
		r.lateForward(ctx, a)
	}
	return reply, a, nil
}

// db is the runner's database in the deployment's schema.
func (r *Runner) db() pgschema.Executor { return r.cfg.Schema.Q(r.cfg.Pool) }

// HandleMsg runs one command message and acks it after its commit.
func (r *Runner) HandleMsg(ctx context.Context, msg jetstream.Msg) {
	r.inHand.Add(1)
	defer r.inHand.Add(-1)
	cmd, err := wire.DecodeCommand(msg.Data())
	if err != nil {
		r.cfg.Logger.Error("step worker: dropping undecodable command", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	if r.cfg.Tracer.Enabled() {
		cmd.Trace = tracing.FromNATS(msg.Headers())
	}
	ctx = withProgress(ctx, func() { _ = msg.InProgress() })
	md, mdErr := msg.Metadata()
	redelivered := mdErr == nil && md.NumDelivered > 1
	// A command this worker cannot run takes no slot from those it can.
	var unknown *UnknownError
	if _, _, err := r.lookup(cmd); errors.As(err, &unknown) {
		r.unknownCommand(ctx, msg, cmd, unknown.Reason)
		return
	}
	if r.slots != nil {
		r.slots <- struct{}{}
		defer func() { <-r.slots }()
	}
	if mdErr == nil && r.late(md) {
		r.claimLease(ctx, cmd)
	}
	r.Run(ctx, cmd, redelivered, func(err error) {
		var unknown *UnknownError
		if errors.As(err, &unknown) {
			r.unknownCommand(ctx, msg, cmd, unknown.Reason)
			return
		}
		if errors.Is(err, ErrCrashed) {
			// The test kit's crash: delivered again, as after its ack
			// wait, at once (the kit's clock does not move the broker's).
			_ = msg.Nak()
			return
		}
		if err != nil {
			r.cfg.Logger.Warn("step worker: command not processed; it will be redelivered", "saga_id", cmd.SagaID, "step", cmd.Step,
				"phase", cmd.Phase, "attempt", cmd.Attempt, "error", err)
			_ = msg.NakWithDelay(time.Second)
			return
		}
		if err := failpoint.Inject(failpoint.StepBeforeAck); err != nil {
			return // as if the ack was lost: JetStream redelivers after AckWait
		}
		if mdErr == nil && md.NumDelivered == 1 && failpoint.Inject(failpoint.StepRedeliver) != nil {
			// As if the ack was lost, without waiting for AckWait.
			_ = msg.Nak()
			return
		}
		if err := msg.Ack(); err != nil {
			// The commit stands; a redelivery is absorbed by the inbox.
			r.cfg.Logger.Debug("step worker: ack failed after commit", "saga_id", cmd.SagaID, "step", cmd.Step, "error", err)
		}
	})
}

// Run runs cmd as a delivery from the broker: done receives nil once its
// outcome committed (or was found committed), or the error that left
// nothing committed; then the steps its moves dispatched run here, one
// after another (Config.Eager).
func (r *Runner) Run(ctx context.Context, cmd wire.Command, redelivered bool, done func(error)) {
	_, a, err := r.handle(ctx, cmd, redelivered, 0, nil)
	if a != nil && a.next != nil {
		// The move that dispatched it committed, whatever becomes of
		// the delivery's ack: only this process knows of the next
		// command until its lease runs out, so it runs in every case.
		defer r.runEager(ctx, a.next, a.pre)
	}
	done(err)
}

// consume queues, on tx, the deletion of the attempt's own command row
// when it runs eagerly: the command is consumed with the outcome tx
// records. A database step queues it with its claim, so that the row stays
// locked, and the relay's sweep (SKIP LOCKED) leaves it, however long the
// attempt runs; a transaction that rolls it back must say so (unconsume).
func (a *attempt) consume(tx *store.Tx) {
	if a.row != 0 && !a.consumed && !a.queued {
		tx.Exec(store.DeleteCommand, nil, a.row)
		a.queued = true
	}
}

// unconsume records that the transaction which deleted the command's row
// rolled back.
func (a *attempt) unconsume() { a.queued = false }

// committed takes what a committed transaction of the attempt leaves: the
// outbox rows to publish, its own command consumed if tx deleted its row,
// and the next command its move dispatched without an outbox row, to run
// here at once (Config.Eager).
func (a *attempt) committed(tx *store.Tx, out *store.Recorded, m *store.Move) {
	a.sent = append(a.sent, tx.Published()...)
	if a.queued {
		a.consumed = true
	}
	if out != nil && out.Dispatched && out.NextID == nil && m != nil && m.Next != nil {
		d := m.Next
		a.next = &outbox.Committed{Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers}
	}
}

// eager reports whether a move of this attempt leaves out the outbox row
// of the step it dispatches, which this process then runs at once.
func (a *attempt) eager() bool {
	return a.plan.InStep && a.r.cfg.Eager && !a.once && a.r.cfg.Publisher != nil && !a.r.draining.Load()
}

// commitWrite queues w on tx, with the deletion of the attempt's own
// command row when it runs eagerly, and commits. A move carries no reply:
// if it missed (the saga moved since the command was store.Recorded), the reply
// is store.Recorded afterwards, in a transaction of its own on tx's connection;
// should that fail, the outcome stands in the inbox, where the step's next
// attempt finds it. Without a move, the reply goes with w.
func (a *attempt) commitWrite(ctx context.Context, tx *store.Tx, w store.Record, reply *outbox.Message) (store.Recorded, error) {
	a.placeFirstRow(tx, &w)
	if w.Move != nil {
		w.Eager = a.eager()
	} else {
		w.Reply = reply
	}
	var out store.Recorded
	store.QueueRecord(tx, &w, &out)
	a.consume(tx)
	var err error
	if a.chainable(w) && !tx.IsImplicit() {
		err = a.commitAndClaim(ctx, tx, w, &out)
	} else {
		err = tx.Commit(ctx)
	}
	conn := tx.Conn()
	if err != nil {
		if !inDoubt(err) {
			return out, err
		}
		// The COMMIT's answer was lost: ask the database what happened.
		resolved, ok := a.resolve(ctx, w, w.Reply, backendOf(conn))
		if !ok {
			return out, err
		}
		a.r.cfg.Logger.Info("step worker: the commit of an attempt's outcome lost its answer and is found committed; going on",
			"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "phase", a.cmd.Phase, "attempt", a.cmd.Attempt, "error", err)
		out = resolved
		tx.SetPublished(committedRows(w, w.Reply, out))
		conn = nil
	}
	a.committed(tx, &out, w.Move)
	if w.Move != nil && out.Led && !out.Moved && reply != nil {
		var err error
		if conn != nil {
			err = a.writeReply(ctx, conn, reply)
		} else {
			err = a.r.cfg.Pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return a.writeReply(ctx, c.Conn(), reply) })
		}
		if err != nil {
			a.r.cfg.Logger.Warn("step worker: the outcome is recorded, but its reply could not be store.Recorded; the step's next attempt will find the outcome",
				"saga_id", a.cmd.SagaID, "step", a.cmd.Step, "phase", a.cmd.Phase, "attempt", a.cmd.Attempt, "error", err)
		}
	}
	return out, nil
}

// commitAndClaim commits tx and, in the same round trip, begins the
// transaction of the step w's move dispatches, with its claim: the step
// runs next, here (chainable). The claim is kept (a.pre, with a.conn) only
// if the move applied and dispatched that step.
func (a *attempt) commitAndClaim(ctx context.Context, tx *store.Tx, w store.Record, out *store.Recorded) error {
	m, d := w.Move, w.Move.Next
	var cl *claim
	next, committed, err := tx.CommitAndBegin(ctx, func(next *store.Tx) {
		cl = queueClaim(next, m.Saga, d.Key, d.Step, d.Phase, 1, policyOf(a.def, d))
	})
	if !committed {
		return err
	}
	if err != nil || !out.Moved || !out.Dispatched {
		// The claim failed after the COMMIT, or is of no use (the move
		// missed): the step, if dispatched, claims on its own.
		next.Rollback(ctx)
		return nil
	}
	a.pre = &preclaim{conn: a.conn, tx: next, key: d.Key, attempt: 1, claim: cl}
	a.conn = nil
	return nil
}

// writeReply writes a reply into the outbox, in a transaction of its own.
func (a *attempt) writeReply(ctx context.Context, c *pgx.Conn, reply *outbox.Message) error {
	tx := store.Implicit(c, a.r.cfg.Schema)
	tx.Queue(store.InsertOutbox, func(row pgx.Row) error {
		var id int64
		if err := row.Scan(&id); err != nil {
			return err
		}
		tx.Sent(outbox.Committed{ID: id, Subject: reply.Subject, MsgID: reply.MsgID, Payload: reply.Payload, Headers: reply.Headers})
		return nil
	}, reply.Subject, reply.MsgID, reply.Payload, pguuid.Of(a.cmd.SagaID), a.handOff(), store.HeadersJSON(reply.Headers))
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	a.sent = append(a.sent, tx.Published()...)
	return nil
}

// handToBroker writes the outbox row of a command that was to run eagerly
// and publishes it: the runner drains, or the attempt failed. Should that
// fail, the step's lease drives it again.
func (r *Runner) handToBroker(ctx context.Context, c outbox.Committed) {
	if c.ID != 0 {
		r.publish(c)
		return
	}
	cmd, err := wire.DecodeCommand(c.Payload)
	if err == nil {
		err = r.db().QueryRow(ctx, store.InsertOutbox, c.Subject, c.MsgID, c.Payload, pguuid.Of(cmd.SagaID), r.handOffMillis(), store.HeadersJSON(c.Headers)).Scan(&c.ID)
	}
	if err != nil {
		// The database is out of reach (a failover, say), and the step's
		// dispatch is committed: send its command without an outbox row
		// rather than leave it to its lease, which drives it again should
		// this copy be lost too.
		r.cfg.Logger.Warn("step worker: a step to run at once could not be store.Recorded to the outbox; its command goes to the broker without it, and its lease drives it again if that is lost",
			"subject", c.Subject, "msg_id", c.MsgID, "error", err)
		c.ID = 0
	}
	r.publish(c)
}

func (r *Runner) handOffMillis() any {
	if r.cfg.Publisher == nil {
		return nil
	}
	return r.cfg.Publisher.PublishAfter()
}

func (a *attempt) replyBase() wire.Reply {
	c := a.cmd
	return wire.Reply{SagaID: c.SagaID, Definition: c.Definition, DefinitionVersion: c.DefinitionVersion, Step: c.Step, Phase: c.Phase, Key: c.Key, Attempt: c.Attempt}
}

// replyMessage is the outbox row of a reply.
func (a *attempt) replyMessage(reply wire.Reply) (*outbox.Message, error) {
	payload, err := json.Marshal(reply)
	if err != nil {
		return nil, fmt.Errorf("encode reply: %w", err)
	}
	return &outbox.Message{
		SagaID:  reply.SagaID,
		Subject: a.r.cfg.Subjects.Reply(reply.Definition),
		// The outcome is part of the id: two deliveries of one attempt can
		// report different outcomes (a retry, then a success), and the
		// broker must not drop the second as a duplicate.
		MsgID:   "r-" + saga.MessageID(reply.Key, reply.Attempt) + "-" + string(reply.Outcome),
		Payload: payload,
		Headers: a.trace,
	}, nil
}

// handOff is the publish_after of the rows an attempt writes
// (Publisher.PublishAfter).
func (a *attempt) handOff() any { return a.r.handOffMillis() }

// move asks the Mover for the in-step move of o, if the plan has one.
func (a *attempt) move(o Outcome) *store.Move {
	if !a.plan.InStep {
		return nil
	}
	m, ok := a.r.cfg.Mover.Move(a.cmd, a.step.Kind, o)
	if !ok {
		return nil
	}
	if m.Next != nil {
		m.Next.Headers = a.trace
	}
	return &m
}

// afterMove makes a move applied by out's statement reported after the
// commit.
func (a *attempt) afterMove(m *store.Move, out *store.Recorded) {
	if m != nil && out.Moved {
		created := out.Created
		a.after = func() { a.r.cfg.Mover.Moved(m, created) }
	}
}
