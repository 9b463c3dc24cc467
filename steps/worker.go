package steps

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/broker"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/lifecycle"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgbatch"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// ConcurrencyDefault is the number of commands a worker handles at once.
const ConcurrencyDefault = 8

// RecentDefault is how many answered attempts a worker remembers.
const RecentDefault = 16384

// Config configures a Worker.
type Config struct {
	// Pool is the database of the inbox, the outbox and the business tables.
	// Required.
	Pool *pgxpool.Pool
	// Consumer returns the consumer of commands, creating it again when the
	// server lost it. Required by Start; Handle works without.
	Consumer broker.ConsumerFunc
	// Subjects names reply subjects. Required.
	Subjects wire.Subjects
	// Definitions the worker can run. Required.
	Definitions []*saga.Definition
	// Concurrency is the number of commands handled at once. Defaults to
	// ConcurrencyDefault.
	Concurrency int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Metrics, if set, is updated.
	Metrics *metrics.Metrics
	// CommittedFunc, if set, is called after each commit that wrote to the
	// outbox, to wake a relay. It is not called when PublishFunc is set.
	CommittedFunc func()
	// PublishFunc, if set, publishes each reply right after its commit
	// (the engine passes outbox.Relay.Publish); the relay's sweep takes a
	// reply over only after HandOff. Without it replies are the relay's to
	// publish at once.
	PublishFunc func(rows ...outbox.Committed)
	// HandOff is how long the relay leaves a reply to PublishFunc.
	// Defaults to outbox.HandOffDefault.
	HandOff time.Duration
	// Recent is how many answered attempts (step key and attempt) the
	// worker remembers, so that another delivery of one is acknowledged
	// without a round trip to the database: a fast path in front of the
	// inbox, which stays the guarantee (a delivery the worker does not
	// remember, or that reaches another process, goes to the inbox). Only
	// outcomes the inbox holds are remembered; a retryable failure is not.
	// Defaults to RecentDefault; -1 remembers nothing.
	Recent int
	// ApplyFunc, if set, applies a step's success to its saga inside the
	// step's own transaction, in place of a reply: the engine passes its
	// orchestrator when it runs the step workers on its own database. Its
	// part runs after a savepoint: on an error the worker rolls it back and
	// commits the step with a reply instead, without running the handler
	// again. A step that goes in one round trip (its claim travels with
	// the handler's held-back last statement, saga.StepContext.ExecLast)
	// has no savepoint, so that it pays no subtransaction: on an error of
	// a statement nothing commits, and the worker runs the attempt again
	// at once, the statement then at once and ApplyFunc's part after a
	// savepoint, without Guess. See Apply and Applied.
	ApplyFunc func(ctx context.Context, a Apply) (Applied, error)
}

// Apply is what Config.ApplyFunc gets: a step's success, inside the step's
// open transaction, after a savepoint (none in a step that goes in one
// round trip: see Config.ApplyFunc).
type Apply struct {
	// Conn holds the step's transaction.
	Conn *pgx.Conn
	// Pending holds the step's statements not yet sent: the savepoint,
	// and before it the handler's held-back last statement
	// (saga.StepContext.ExecLast); or, when nothing went before that
	// statement, the step's claim, BEGIN and the statement, without a
	// savepoint. ApplyFunc sends them before anything
	// else, with its own reads, in one round trip, or returns them with
	// its writes (or returns no writes, and the worker sends them).
	// Errors of a batch that carried them must wrap the batch's error.
	Pending *pgx.Batch
	// Command is the step's command, and Reply its success.
	Command wire.Command
	Reply   wire.Reply
	// Guess allows ApplyFunc to queue its writes without reading anything,
	// from what the command says of the saga, each write fenced so that a
	// saga or step that moved meanwhile fails the batch. The worker sends
	// them with COMMIT: one round trip for the whole success. If they fail,
	// it rolls back to the savepoint and calls ApplyFunc again without
	// Guess (or, without a savepoint, runs the attempt again).
	Guess bool
}

// Applied is what Config.ApplyFunc returns.
type Applied struct {
	// Writes go with COMMIT. Nil when the success is not to be applied
	// (the attempt is stale, say; a reply would be dropped too).
	Writes *pgx.Batch
	// After, if not nil, runs once the transaction committed.
	After func()
	// Guessed reports writes queued without a read (Apply.Guess). Such
	// writes must record the result in the step's row: the worker then
	// leaves it out of the inbox row, whose readers take it from there.
	Guessed bool
}

// errHandlerEndedTx is returned when a handler succeeded after ending the
// step's transaction through the connection.
var errHandlerEndedTx = errors.New("the handler returned success after ending the step's transaction through sc.Tx.Conn() (COMMIT, ROLLBACK or PREPARE TRANSACTION), so the success cannot be recorded with its effect, and writes made after that may have committed on their own; do not end the step's transaction: return nil to commit it, an error to roll it back")

// errApplyDroppedPending is returned when ApplyFunc returned writes that
// leave out Apply.Pending without having sent it.
var errApplyDroppedPending = errors.New("steps: Config.ApplyFunc returned writes without Apply.Pending, which it had not sent; send Pending first, or queue the writes on it")

// errApplyResentPending is returned when ApplyFunc returned as its writes
// the batch Apply.Pending after sending it.
var errApplyResentPending = errors.New("steps: Config.ApplyFunc returned Apply.Pending as its writes after sending it; queue the writes on a new batch once Pending is sent")

// errApplyInOneTrip marks an attempt whose success, applied in the step's
// one round trip (which has no savepoint to roll back to), failed:
// nothing of it is to commit, and the worker runs it again at once, the
// statement then at once and the success after a savepoint, read rather
// than guessed.
var errApplyInOneTrip = errors.New("the step's success could not be applied in the round trip of its last statement")

// errApplyInStep marks a failed ApplyFunc whose step could not be saved
// either: nothing committed, and the command is delivered again.
var errApplyInStep = errors.New("apply the success in the step's transaction")

// The savepoint behind which ApplyFunc's part of a step runs.
const (
	savepointApply = "savepoint idemsaga_apply"
	rollbackApply  = "rollback to savepoint idemsaga_apply"
)

// attempt is what a committed attempt leaves to do after its commit.
type attempt struct {
	sent  []outbox.Committed // outbox rows to publish
	after func()             // ApplyFunc's, if it applied the success
	// stored is set when the inbox holds this attempt's outcome (a
	// success or a permanent failure committed, or found there).
	stored bool
	// read is set when a redelivery's read of the inbox answered it,
	// without a claim.
	read bool
}

// Worker consumes and runs step commands.
type Worker struct {
	cfg    Config
	defs   map[string]*saga.Definition
	recent *recent // nil when Config.Recent is -1
	runner lifecycle.Runner
}

// New returns a worker; Start runs it.
func New(cfg Config) (*Worker, error) {
	switch {
	case cfg.Pool == nil:
		return nil, errors.New("steps: Config.Pool is required")
	case cfg.Subjects.Prefix == "":
		return nil, errors.New("steps: Config.Subjects is required")
	case len(cfg.Definitions) == 0:
		return nil, errors.New("steps: Config.Definitions is empty; give the worker the sagas it runs")
	case cfg.Concurrency < 0:
		return nil, fmt.Errorf("steps: Config.Concurrency is %d; use a positive number, or 0 for %d", cfg.Concurrency, ConcurrencyDefault)
	case cfg.HandOff < 0:
		return nil, fmt.Errorf("steps: Config.HandOff is %s; use a positive duration, or 0 for %s", cfg.HandOff, outbox.HandOffDefault)
	case cfg.Recent < -1:
		return nil, fmt.Errorf("steps: Config.Recent is %d; use a positive number, 0 for %d, or -1 to remember nothing", cfg.Recent, RecentDefault)
	}
	if cfg.Recent == 0 {
		cfg.Recent = RecentDefault
	}
	if cfg.HandOff == 0 {
		cfg.HandOff = outbox.HandOffDefault
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = ConcurrencyDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics, _ = metrics.New(nil)
	}
	w := &Worker{cfg: cfg, defs: make(map[string]*saga.Definition)}
	if cfg.Recent > 0 {
		var err error
		if w.recent, err = newRecent(cfg.Recent); err != nil {
			return nil, fmt.Errorf("steps: %w", err)
		}
	}
	for _, d := range cfg.Definitions {
		if _, dup := w.defs[d.Name()]; dup {
			return nil, fmt.Errorf("steps: definition %q is given twice", d.Name())
		}
		w.defs[d.Name()] = d
	}
	return w, nil
}

// Start runs the worker in the background until Stop.
func (w *Worker) Start(ctx context.Context) error {
	if w.cfg.Consumer == nil {
		return errors.New("steps: Config.Consumer is required to start the worker")
	}
	if err := w.checkMigrated(ctx); err != nil {
		return err
	}
	return w.runner.Start(ctx, func(ctx context.Context) {
		broker.Pool(ctx, w.cfg.Logger, w.cfg.Consumer, w.cfg.Concurrency, w.HandleMsg)
	})
}

// checkMigrated fails when the database is unreachable or lacks this
// build's migrations: the claim calls functions they create, and without
// them every command would be refused and delivered again, forever.
func (w *Worker) checkMigrated(ctx context.Context) error {
	conn, err := w.cfg.Pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("step worker: database unreachable: %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.Check(ctx, conn.Conn()); err != nil {
		return fmt.Errorf("step worker: %w", err)
	}
	return nil
}

// Stop finishes the commands in hand and returns. Calling it twice is fine.
func (w *Worker) Stop(ctx context.Context) error { return w.runner.Stop(ctx) }

// HandleMsg runs one command message and acks it after commit. A message
// JetStream delivered before (NumDelivered above 1) goes through
// HandleRedelivered.
func (w *Worker) HandleMsg(ctx context.Context, msg jetstream.Msg) {
	cmd, err := wire.DecodeCommand(msg.Data())
	if err != nil {
		w.cfg.Logger.Error("step worker: dropping undecodable command", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	// The logger's attributes are built only when there is something to
	// log: a handler pre-formats them, for every message otherwise.
	log := func() *slog.Logger {
		return w.cfg.Logger.With("saga_id", cmd.SagaID, "step", cmd.Step, "phase", cmd.Phase, "attempt", cmd.Attempt)
	}
	// A delivery after the first is most often of a command that
	// committed and whose ack was lost.
	md, mdErr := msg.Metadata()
	redelivered := mdErr == nil && md.NumDelivered > 1
	if _, err := w.handle(ctx, cmd, redelivered); err != nil {
		log().Warn("step worker: command not processed; it will be redelivered", "error", err)
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
		log().Debug("step worker: ack failed after commit", "error", err)
	}
}

// Handle runs one command to a committed reply. It returns the reply: the
// one written, or, for a redelivery of an attempt already answered, the
// stored outcome (Duplicate set), whose reply is already in the outbox. An
// error means nothing was committed and the command should be delivered
// again.
func (w *Worker) Handle(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.handle(ctx, cmd, false)
}

// HandleRedelivered is Handle for a command the transport delivered before
// (JetStream's NumDelivered above 1; HandleMsg tells them apart by
// itself). Such a delivery is most often of an attempt that committed and
// whose ack was lost, so the inbox is read before anything is claimed: a
// duplicate is answered by that plain read, which costs PostgreSQL a
// fraction of the claim's raise (Handle's duplicate path), and an attempt
// the inbox does not hold goes on to the claim as in Handle, one round
// trip later.
func (w *Worker) HandleRedelivered(ctx context.Context, cmd wire.Command) (wire.Reply, error) {
	return w.handle(ctx, cmd, true)
}

func (w *Worker) handle(ctx context.Context, cmd wire.Command, redelivered bool) (wire.Reply, error) {
	def, ok := w.defs[cmd.Definition]
	if !ok {
		return wire.Reply{}, fmt.Errorf("%w: %q", saga.ErrUnknownDefinition, cmd.Definition)
	}
	idx := def.StepIndex(cmd.Step)
	if idx < 0 {
		return wire.Reply{}, fmt.Errorf("definition %q has no step %q; deploy the same definition to every worker", cmd.Definition, cmd.Step)
	}
	step := def.Step(idx)
	handler, policy := step.Forward, step.Retry
	if cmd.Phase == saga.PhaseCompensate {
		handler, policy = step.Compensate, step.CompensateRetry
	}

	// The wait is bounded as the attempt is: a run that hangs must not
	// gather its copies here, each holding a slot of the worker.
	waitCtx, cancelWait := context.WithTimeout(ctx, policy.Timeout)
	a, ok, release, err := w.await(waitCtx, cmd)
	cancelWait()
	if err != nil {
		return wire.Reply{}, fmt.Errorf("another delivery of this attempt is still running in this worker: %w", err)
	}
	if ok {
		// Another delivery of an attempt this worker answered: the inbox
		// holds its outcome and its reply or effect committed with it;
		// as in the inbox's own duplicate path, nothing is written.
		w.cfg.Metrics.Deliveries.WithLabelValues(metrics.LayerInbox).Inc()
		w.cfg.Metrics.Duplicates.WithLabelValues(metrics.LayerRecent).Inc()
		w.cfg.Metrics.StepAttempts.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase), "duplicate").Inc()
		return wire.Reply{
			SagaID: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step, Phase: cmd.Phase,
			Key: cmd.Key, Attempt: cmd.Attempt, Outcome: a.outcome, Result: bytes.Clone(a.result), Error: a.errText, Duplicate: true,
		}, nil
	}
	defer release()
	start := time.Now()
	var done attempt
	// A TxOnly forward step's claim goes with its first statement.
	held := cmd.Phase == saga.PhaseForward && step.TxOnly
	reply, err := w.run(ctx, cmd, handler, policy, held, redelivered, false, true, &done)
	if errors.Is(err, errLastFailed) || errors.Is(err, errApplyInOneTrip) {
		// Nothing of the attempt committed. The handler runs again, its
		// last statement at once, to judge that statement's error, or to
		// apply the success after a savepoint (reading the saga: the
		// guess already failed).
		w.cfg.Logger.Debug("step worker: the round trip of the step's last statement and its success failed; running the handler again",
			"saga_id", cmd.SagaID, "step", cmd.Step, "phase", cmd.Phase, "attempt", cmd.Attempt, "error", err)
		w.cfg.Metrics.LastStatementReruns.WithLabelValues(cmd.Definition, cmd.Step).Inc()
		done = attempt{}
		reply, err = w.run(ctx, cmd, handler, policy, held, false, true, !errors.Is(err, errApplyInOneTrip), &done)
	}
	if err != nil {
		return reply, err
	}
	if done.after != nil {
		done.after()
	}
	w.remember(cmd, reply, done.stored)
	if w.cfg.PublishFunc != nil {
		w.cfg.PublishFunc(done.sent...)
	} else if w.cfg.CommittedFunc != nil {
		w.cfg.CommittedFunc()
	}
	w.cfg.Metrics.Deliveries.WithLabelValues(metrics.LayerInbox).Inc()
	outcome := string(reply.Outcome)
	if reply.Duplicate {
		if !done.read {
			// The claim's insert met the inbox row.
			w.cfg.Metrics.UniqueConflicts.WithLabelValues("inbox").Inc()
		}
		outcome = "duplicate"
		w.cfg.Metrics.Duplicates.WithLabelValues(metrics.LayerInbox).Inc()
	}
	w.cfg.Metrics.StepAttempts.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase), outcome).Inc()
	w.cfg.Metrics.StepHandler.WithLabelValues(cmd.Definition, cmd.Step, string(cmd.Phase)).Observe(time.Since(start).Seconds())
	return reply, nil
}

// run runs one attempt to its commit; done receives what is left to do
// after the commit. With Config.ApplyFunc a success is applied to the saga
// in the same transaction instead of replied. A redelivered command reads
// the inbox first (HandleRedelivered).
//
// In a TxOnly forward step's first run (held, not again), the handler's
// ExecLast statement is held back for the success's round trip
// (lastStatement); if it fails, run returns errLastFailed and handle runs
// the attempt again with again set, ExecLast then running at once.
func (w *Worker) run(ctx context.Context, cmd wire.Command, handler saga.HandlerFunc, policy saga.RetryPolicy, held, redelivered, again, guess bool, done *attempt) (wire.Reply, error) {
	sent := &done.sent
	reply := wire.Reply{
		SagaID: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step,
		Phase: cmd.Phase, Key: cmd.Key, Attempt: cmd.Attempt,
	}
	attemptCtx, cancel := context.WithTimeout(ctx, policy.Timeout)
	defer cancel()

	conn, err := w.cfg.Pool.Acquire(attemptCtx)
	if err != nil {
		return reply, fmt.Errorf("acquire a connection: %w", err)
	}
	// A connection still inside a transaction when released (an error
	// midway that rollback could not clear) is closed by the pool.
	released := false
	defer func() {
		if !released {
			conn.Release()
		}
	}()
	tx := newStepTx(conn.Conn())
	tx.step.holdLast = held && !again
	defer func() {
		tx.close()
		if !released && conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "rollback")
		}
	}()

	if redelivered {
		// What the inbox holds is final: a row is there only once its
		// attempt committed. Nothing there, and the claim decides, as
		// for any delivery (it waits for an attempt still running).
		var st stored
		err := st.scan(conn.QueryRow(attemptCtx, readStored, pguuid.Of(cmd.SagaID), pguuid.Of(cmd.Key)))
		switch {
		case err == nil:
			if string(st.result) == "null" {
				st.result = nil // as the claim's raise carries it (fromRaise)
			}
			done.read = true
			return w.answerStored(attemptCtx, conn, tx, cmd, st, reply, done)
		case !errors.Is(err, pgx.ErrNoRows):
			return reply, err
		}
	}

	// First round trip: the claim (the inbox claim with the idle bound,
	// then BEGIN). A TxOnly step's travels with its handler's first
	// statement instead.
	cl := newClaim(cmd, policy)
	if held {
		tx.holdClaim(attemptCtx, cl, func() error { return failpoint.Inject(failpoint.StepAfterInbox) })
	} else {
		if _, err := cl.send(attemptCtx, conn.Conn(), "", nil); err != nil {
			return reply, err
		}
		if cl.claimed == 0 {
			return w.answerStored(attemptCtx, conn, tx, cmd, cl.st, reply, done)
		}
		if err := failpoint.Inject(failpoint.StepAfterInbox); err != nil {
			return reply, err
		}
	}
	result, herr := w.invoke(attemptCtx, tx, cmd, handler)
	last := tx.step.last
	if herr != nil {
		last = nil // never sent: nothing of it to undo
	}
	if last != nil && held && !cl.sent {
		// The held-back last statement carries the claim: the whole
		// step is the success's round trip.
		if err := failpoint.Inject(failpoint.StepAfterInbox); err != nil {
			return reply, err
		}
		last.claim = cl
	} else if held && !cl.sent && herr == nil {
		// The handler made no statement: the claim goes now, before its
		// success is recorded. (After a failure, nothing was done here,
		// and the failure is recorded as any other: its record adjudicates
		// through the inbox by itself.)
		_, _, _ = tx.sendClaim(attemptCtx, "", nil)
	}
	if held && cl.sent && (last == nil || last.claim == nil) {
		switch {
		case cl.err != nil:
			return reply, cl.err
		case cl.claimed == 0:
			// Whatever the handler did or returned, the inbox answered
			// first; its statement was rolled back with the claim.
			return w.answerStored(attemptCtx, conn, tx, cmd, cl.st, reply, done)
		}
	}
	if herr == nil && cl.sent && conn.Conn().PgConn().TxStatus() == 'I' {
		// The claim's transaction is gone: the handler ended it on the
		// connection. Its success would commit on its own, with no claim
		// and maybe no effect. It fails for good instead: a rollback's
		// failure is recorded; after a commit, the failure's record finds
		// the claim's row and the reply answers with its success.
		herr = saga.Permanent(fmt.Errorf("step %q of %q: %w", cmd.Step, cmd.Definition, errHandlerEndedTx))
	}
	if herr == nil {
		// Last round trip: the result into the inbox row (or, applied to
		// the saga as the command foresaw, into the step's row alone), the
		// reply into the outbox, COMMIT.
		reply.Outcome, reply.Result = wire.OutcomeSucceeded, result
		if w.cfg.ApplyFunc != nil {
			err = w.applyAndCommit(attemptCtx, conn, cmd, reply, done, last, guess)
		} else {
			b := recordResultOf(cmd, result, last.batch())
			err = w.replyAndCommit(attemptCtx, conn, reply, b, sent, last.inOneTrip(b))
		}
		if last.leads(err) {
			gone := attemptCtx.Err() != nil || conn.Conn().IsClosed()
			if err := last.judge(err, gone); err != nil {
				return reply, err
			}
			// A duplicate, found by the claim the statement carried.
			return w.answerStored(attemptCtx, conn, tx, cmd, cl.st, reply, done)
		}
		done.stored = err == nil
		return reply, err
	}

	// The handler failed: nothing it or we wrote survives.
	tx.close()
	var fdb interface {
		Begin(ctx context.Context) (pgx.Tx, error)
	} = conn
	// A handler that failed before its held-back claim went out opened no
	// transaction: nothing to roll back, and no round trip for it.
	if conn.Conn().PgConn().TxStatus() != 'I' {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "rollback"); err != nil {
			// The connection broke (a statement cut by the attempt's
			// timeout, a restarted server): give it back first (the pool
			// closes it), so that a pool whose connections all broke at
			// once is not left waiting on itself, and record the failure
			// on another one.
			conn.Release()
			released = true
			fdb = w.cfg.Pool
		}
	}
	reply.Error = herr.Error()
	if d, ok := saga.RetryDelay(herr); ok {
		reply.RetryAfterMillis = d.Milliseconds()
	}
	// Record the failure under a fresh context: the attempt's may have
	// expired, and the outcome must still be reported.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer rcancel()
	ftx, err := fdb.Begin(rctx)
	if err != nil && !released {
		// A connection that broke while idle still reads as idle until
		// it is used: this BEGIN found out. Give it back and record the
		// failure on another one, as above.
		conn.Release()
		released = true
		ftx, err = w.cfg.Pool.Begin(rctx)
	}
	if err != nil {
		return reply, fmt.Errorf("begin failure record: %w", err)
	}
	defer ftx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	recorded := false
	if saga.IsPermanent(herr) {
		tag, err := ftx.Exec(rctx, recordFailure, pguuid.Of(cmd.Key), pguuid.Of(cmd.SagaID), cmd.Step, cmd.Phase, cmd.Attempt, reply.Error)
		if err != nil {
			return reply, fmt.Errorf("record permanent failure: %w", err)
		}
		if tag.RowsAffected() == 0 {
			// Someone else recorded an outcome meanwhile: that one stands.
			if reply, err = storedReply(rctx, ftx, reply); err != nil {
				return reply, err
			}
		} else {
			reply.Outcome, recorded = wire.OutcomeFailed, true
		}
	} else {
		reply.Outcome = wire.OutcomeRetry
	}
	if err := w.writeReply(rctx, ftx, reply, sent); err != nil {
		return reply, err
	}
	if err := ftx.Commit(rctx); err != nil {
		return reply, fmt.Errorf("commit failure record: %w", err)
	}
	done.stored = recorded
	return reply, nil
}

// cloneResults copies results, values included.
func cloneResults(results map[string]json.RawMessage) map[string]json.RawMessage {
	if results == nil {
		return nil
	}
	out := make(map[string]json.RawMessage, len(results))
	for k, v := range results {
		out[k] = bytes.Clone(v)
	}
	return out
}

// answerStored answers a delivery whose key the inbox held already (or
// tombstoned) with the first outcome. The claim or the read that found it
// left no transaction open (and a handler's statement that travelled with
// a claim was rolled back with it).
func (w *Worker) answerStored(ctx context.Context, conn *pgxpool.Conn, tx *stepTx, cmd wire.Command, st stored, reply wire.Reply, done *attempt) (wire.Reply, error) {
	tx.close()
	reply, err := st.reply(reply)
	if err != nil {
		return reply, err
	}
	if conn.Conn().PgConn().TxStatus() != 'I' {
		if _, err := conn.Exec(ctx, "rollback"); err != nil {
			return reply, fmt.Errorf("end the transaction of a duplicate delivery: %w", err)
		}
	}
	if st.attempt == cmd.Attempt && st.outcome != "tombstone" {
		// The same attempt, delivered again: its reply committed with the
		// inbox row, so it is in the outbox already (and a lost one is
		// re-driven by the lease, under a new attempt). Write nothing.
		done.stored = true
		return reply, nil
	}
	// Another attempt's outcome: answer this one with a reply.
	b := &pgx.Batch{}
	b.Queue("begin")
	return reply, w.replyAndCommit(ctx, conn, reply, b, &done.sent, false)
}

// invoke runs the handler, turning a panic into a retryable error. For a
// compensation it first tombstones the forward key and runs the handler only
// if the forward step took effect.
func (w *Worker) invoke(ctx context.Context, tx pgx.Tx, cmd wire.Command, handler saga.HandlerFunc) (result json.RawMessage, err error) {
	sc := &saga.StepContext{
		SagaID: cmd.SagaID, Definition: cmd.Definition, Step: cmd.Step, Phase: cmd.Phase,
		// Copies of the input and results: the command's own may become the
		// next command's (Apply.Guess), whatever the handler does to its.
		Key: cmd.Key, Attempt: cmd.Attempt, Input: bytes.Clone(cmd.Input), Results: cloneResults(cmd.Results), Tx: tx,
	}
	if cmd.Phase == saga.PhaseCompensate {
		forwardKey := saga.StepKey(cmd.SagaID, cmd.Step, saga.PhaseForward)
		tag, err := tx.Exec(ctx, tombstone, forwardKey, cmd.SagaID, cmd.Step)
		if err != nil {
			return nil, fmt.Errorf("tombstone forward key: %w", err)
		}
		if tag.RowsAffected() == 1 {
			return nil, nil // the forward step never ran and now never will
		}
		var fwd stored
		if err := fwd.scan(tx.QueryRow(ctx, readStored, cmd.SagaID, forwardKey)); err != nil {
			return nil, fmt.Errorf("read forward outcome: %w", err)
		}
		if fwd.outcome != "succeeded" {
			return nil, nil // the forward step took no effect: nothing to undo
		}
		if handler == nil {
			return nil, saga.Permanent(fmt.Errorf("step %q took effect and has no compensation; its effect must be undone by hand", cmd.Step))
		}
		results := make(map[string]json.RawMessage, len(cmd.Results)+1)
		for k, v := range cmd.Results {
			results[k] = v
		}
		if fwd.result != nil || results[cmd.Step] == nil {
			// The inbox's result, unless it has none and the command
			// carries one (from the saga's results): a success applied in
			// its step keeps its result in the step's row alone, which an
			// older step worker's read does not see.
			results[cmd.Step] = fwd.result
		}
		sc.Results = results
	}
	if handler == nil {
		return nil, nil
	}
	defer func() {
		if p := recover(); p != nil {
			result, err = nil, fmt.Errorf("step handler panicked: %v", p)
		}
	}()
	return handler(ctx, sc)
}

// stored is what the inbox holds for a step key.
type stored struct {
	outcome string
	result  []byte
	errText string
	attempt int
}

// scan reads a row of readStored.
func (st *stored) scan(row pgx.Row) error {
	if err := row.Scan(&st.outcome, &st.result, &st.errText, &st.attempt); err != nil {
		return fmt.Errorf("read the inbox: %w", err)
	}
	return nil
}

// reply fills r with the stored outcome, as a duplicate.
func (st stored) reply(r wire.Reply) (wire.Reply, error) {
	r.Duplicate = true
	switch st.outcome {
	case "succeeded":
		r.Outcome, r.Result = wire.OutcomeSucceeded, st.result
	case "failed":
		r.Outcome, r.Error = wire.OutcomeFailed, st.errText
	case "tombstone":
		// The orchestrator gave up on this forward step and compensated
		// it; there is nobody to answer.
		r.Outcome, r.Error = wire.OutcomeFailed, "step was abandoned and compensated before this delivery"
	default:
		return r, fmt.Errorf("unknown stored outcome %q", st.outcome)
	}
	return r, nil
}

// storedReply fills reply with the outcome the inbox holds for its key.
func storedReply(ctx context.Context, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, reply wire.Reply) (wire.Reply, error) {
	var st stored
	if err := st.scan(q.QueryRow(ctx, readStored, pguuid.Of(reply.SagaID), pguuid.Of(reply.Key))); err != nil {
		return reply, err
	}
	return st.reply(reply)
}

// applyAndCommit hands the step's success to ApplyFunc, which applies it
// to the saga, and commits: one round trip when ApplyFunc can guess from
// the command, two when it must read first, and no reply. The saga's part
// runs after a savepoint: if it fails (the saga cannot take the success,
// say), it alone is rolled back and the step's own writes commit with a
// reply instead, for the orchestrator, without running the handler again.
//
// A success applied as the command foresaw (Applied.Guessed) leaves its
// result in the step's row, written in the same transaction, and not in
// the inbox row too: the inbox's readers take it from there (readStored).
// Every other way records it in the inbox row.
//
// A handler's held-back last statement (and the claim it may carry) leads
// the batch, before the savepoint; an error of its is returned at once,
// for run to judge (lastStatement.leads). When it carries the claim the
// step is one round trip, without a savepoint: a failure of a statement
// after it is returned as errApplyInOneTrip, for run to run the attempt
// again; one at the commit, or of an attempt or connection gone, as it
// is.
func (w *Worker) applyAndCommit(ctx context.Context, conn *pgxpool.Conn, cmd wire.Command, reply wire.Reply, done *attempt, last *lastStatement, guess bool) error {
	b := last.batch()
	// The step in one round trip (its claim travels with the held-back
	// statement) takes no savepoint: a subtransaction per step.
	oneTrip := last != nil && last.claim != nil
	if !oneTrip {
		b.Queue(savepointApply)
	}
	a := Apply{Conn: conn.Conn(), Pending: b, Command: cmd, Reply: reply, Guess: guess}
	res, err := w.cfg.ApplyFunc(ctx, a)
	if err == nil && last != nil && last.ran && res.Writes == b {
		return errApplyResentPending
	}
	if err == nil && last != nil && !last.ran {
		// Pending holds the handler's statement (and maybe the claim):
		// it must go, before anything else, or nothing may commit.
		switch {
		case res.Writes == nil:
			res.Writes = b // no writes of ApplyFunc's: the step's own commit
		case res.Writes != b:
			return errApplyDroppedPending
		}
	}
	if err == nil {
		// The whole transaction goes in this batch when it holds the
		// claim, the statement and the writes, unsent.
		implicit := res.Writes == b && last.inOneTrip(b)
		err = commitApplied(ctx, conn, res, cmd, reply.Result, implicit)
	}
	if last.leads(err) {
		return err
	}
	if err != nil && oneTrip {
		// No savepoint to go back to: nothing of the attempt is to
		// commit. While the attempt and its connection live, and unless
		// the failure came at the commit, the handler runs again with its
		// statement at once, then this after a savepoint, reading the
		// saga; otherwise the attempt ends here, to be delivered again.
		if ctx.Err() != nil || conn.Conn().IsClosed() || pgconn.Timeout(err) || errors.Is(err, pgbatch.ErrAtSync) {
			return err
		}
		return fmt.Errorf("%w: %w", errApplyInOneTrip, err)
	}
	if err != nil && res.Guessed {
		// The saga or the step moved since the command was written: read
		// and judge. ROLLBACK TO keeps the savepoint for the fallback below.
		// It goes alone: pgx would prepare a batch's new statements first,
		// which an aborted transaction refuses.
		w.cfg.Logger.Debug("step worker: the success could not be applied as the command foresaw; reading the saga",
			"saga_id", reply.SagaID, "step", reply.Step, "phase", reply.Phase, "attempt", reply.Attempt, "error", err)
		if _, err = conn.Exec(ctx, rollbackApply); err == nil {
			a.Pending, a.Guess = &pgx.Batch{}, false
			if res, err = w.cfg.ApplyFunc(ctx, a); err == nil {
				err = commitApplied(ctx, conn, res, cmd, reply.Result, false)
			}
		}
	}
	if err == nil {
		done.after = res.After
		return nil
	}
	w.cfg.Logger.Warn("step worker: the success could not be applied in the step's transaction; answering with a reply",
		"saga_id", reply.SagaID, "step", reply.Step, "phase", reply.Phase, "attempt", reply.Attempt, "error", err)
	if _, rerr := conn.Exec(ctx, rollbackApply); rerr != nil {
		return fmt.Errorf("%w: %w (and the step's own writes could not be saved: %w)", errApplyInStep, err, rerr)
	}
	return w.replyAndCommit(ctx, conn, reply, recordResultOf(cmd, reply.Result, nil), &done.sent, false)
}

// commitApplied sends ApplyFunc's writes with COMMIT (none when implicit:
// the batch is the whole transaction, committed at its Sync), and the
// result into the inbox row unless they applied it as the command foresaw.
func commitApplied(ctx context.Context, conn *pgxpool.Conn, res Applied, cmd wire.Command, result json.RawMessage, implicit bool) error {
	writes := res.Writes
	if writes == nil {
		writes = &pgx.Batch{}
	}
	if !res.Guessed {
		recordResultOf(cmd, result, writes)
	}
	if !implicit {
		queueCommit(writes)
	}
	if err := pgbatch.Run(ctx, conn, writes); err != nil {
		return err
	}
	if conn.Conn().PgConn().TxStatus() != 'I' {
		return errors.New("the transaction is still open after COMMIT")
	}
	return nil
}

// recordResultOf queues the result of a success into its inbox row, on b
// or on a new batch, and returns the batch.
func recordResultOf(cmd wire.Command, result json.RawMessage, b *pgx.Batch) *pgx.Batch {
	if b == nil {
		b = &pgx.Batch{}
	}
	b.Queue(recordResult, pguuid.Of(cmd.SagaID), pguuid.Of(cmd.Key), nullJSON(result))
	return b
}

// replyAndCommit sends the statements of b (if any), the reply's outbox
// row and COMMIT (none when implicit, as in commitApplied), in one round
// trip.
func (w *Worker) replyAndCommit(ctx context.Context, conn *pgxpool.Conn, reply wire.Reply, b *pgx.Batch, sent *[]outbox.Committed, implicit bool) error {
	if b == nil {
		b = &pgx.Batch{}
	}
	if err := w.queueReply(b, reply, sent); err != nil {
		return err
	}
	if !implicit {
		queueCommit(b)
	}
	if err := pgbatch.Run(ctx, conn, b); err != nil {
		return fmt.Errorf("record the outcome and reply: %w", err)
	}
	if conn.Conn().PgConn().TxStatus() != 'I' {
		return errors.New("record the outcome and reply: the transaction is still open after COMMIT")
	}
	return nil
}

func (w *Worker) writeReply(ctx context.Context, tx pgx.Tx, reply wire.Reply, sent *[]outbox.Committed) error {
	b := &pgx.Batch{}
	if err := w.queueReply(b, reply, sent); err != nil {
		return err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("outbox: insert reply: %w", err)
	}
	return nil
}

// queueReply adds the reply's outbox row to b. With a PublishFunc the row
// is handed off: sent receives it when b runs, to publish after commit.
func (w *Worker) queueReply(b *pgx.Batch, reply wire.Reply, sent *[]outbox.Committed) error {
	payload, err := json.Marshal(reply)
	if err != nil {
		return fmt.Errorf("encode reply: %w", err)
	}
	m := outbox.Message{
		SagaID:  reply.SagaID,
		Subject: w.cfg.Subjects.Reply(reply.Definition),
		// The outcome is part of the id: two deliveries of one attempt can
		// report different outcomes (a retryable error, then a success),
		// and the broker must not drop the second as a duplicate.
		MsgID:   "r-" + saga.MessageID(reply.Key, reply.Attempt) + "-" + string(reply.Outcome),
		Payload: payload,
	}
	if w.cfg.PublishFunc == nil {
		return outbox.Queue(b, m)
	}
	return outbox.QueueHandedOff(b, m, w.cfg.HandOff, func(c outbox.Committed) { *sent = append(*sent, c) })
}

// queueCommit adds COMMIT to b, and fails the batch if PostgreSQL
// answered ROLLBACK: the transaction had failed.
func queueCommit(b *pgx.Batch) {
	b.Queue("commit").Exec(func(tag pgconn.CommandTag) error {
		if tag.String() == "ROLLBACK" {
			return errors.New("the transaction had failed; COMMIT rolled it back")
		}
		return nil
	})
}

// idleTimeoutFor is the longest a step transaction may sit idle: the
// attempt's timeout plus a margin. PostgreSQL ends the session past it.
func idleTimeoutFor(p saga.RetryPolicy) string {
	return fmt.Sprintf("%dms", (p.Timeout + 5*time.Second).Milliseconds())
}

func nullJSON(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return []byte(b)
}
