package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/steps"
)

// Verdict says what applying a reply did.
type Verdict string

// Verdicts of ApplyReply.
const (
	// VerdictApplied: the reply moved the step and the saga.
	VerdictApplied Verdict = "applied"
	// VerdictDuplicate: the step already had this outcome; nothing changed.
	VerdictDuplicate Verdict = "duplicate"
	// VerdictStale: the reply belongs to an older attempt; nothing changed.
	VerdictStale Verdict = "stale"
	// VerdictMissing: the saga or step no longer exists; nothing changed.
	VerdictMissing Verdict = "missing"
)

type stepRow struct {
	index   int
	phase   saga.Phase
	status  saga.StepStatus
	attempt int
}

// judge decides, from the step's stored row alone, whether a reply may be
// applied. It is pure so that it can be tested exhaustively.
func judge(st stepRow, r wire.Reply) Verdict {
	switch {
	case r.Attempt > st.attempt:
		// A reply from the future cannot exist: its command was never
		// dispatched. Treat it as stale rather than trust it.
		return VerdictStale
	case r.Attempt < st.attempt:
		return VerdictStale
	case st.status == saga.StepRetrying && r.Outcome == wire.OutcomeSucceeded:
		// A retry was scheduled, but a redelivery of the same attempt
		// succeeded: the success is the truth, and stops the retry.
		return VerdictApplied
	case st.status == saga.StepSucceeded || st.status == saga.StepFailed || st.status == saga.StepRetrying:
		return VerdictDuplicate
	default:
		return VerdictApplied
	}
}

// ApplyReply records one reply in one transaction: the step's outcome, the
// saga's transition and the next command. It is idempotent: a duplicate or
// stale reply changes nothing.
func (c *core) ApplyReply(ctx context.Context, r wire.Reply) (Verdict, error) {
	def, err := c.definition(r.Definition)
	if err != nil {
		return "", err
	}
	idx := def.StepIndex(r.Step)
	if idx < 0 {
		return "", fmt.Errorf("definition %q has no step %q; deploy the same definition everywhere", r.Definition, r.Step)
	}
	fx := &effects{}
	v, err := c.applyReply(ctx, def, idx, r, fx)
	if err == nil && v == VerdictApplied {
		// After the connection went back to the pool: OnFinishedFunc may
		// use the pool itself.
		c.emit(fx)
	}
	return v, err
}

func (c *core) applyReply(ctx context.Context, def *saga.Definition, idx int, r wire.Reply, fx *effects) (Verdict, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return "", fmt.Errorf("acquire a connection: %w", err)
	}
	defer conn.Release()
	t := newConnTxn(conn)
	defer t.rollback(ctx)

	// First round trip: BEGIN, lock the saga, read the step. Second: the
	// writes and COMMIT.
	v, err := c.judgeAndQueue(ctx, t, def, idx, r, fx)
	if err == nil && v == VerdictApplied {
		err = t.commit(ctx)
	}
	if errors.Is(err, errAlreadyApplied) {
		return VerdictDuplicate, nil
	}
	if err != nil {
		return "", err
	}
	if v == VerdictApplied {
		fx.sent = t.sent
	}
	return v, nil
}

// judgeAndQueue locks the reply's saga (the order every writer takes:
// saga, then step), reads its step, and judges the reply: in one round
// trip, with whatever t had queued. An applicable reply's writes are
// queued on t, for the caller to commit.
func (c *core) judgeAndQueue(ctx context.Context, t *txn, def *saga.Definition, idx int, r wire.Reply, fx *effects) (Verdict, error) {
	var sg *saga.Instance
	var st stepRow
	var phase, status string
	stepFound := true
	t.queue(selectSagaByIDLocked, func(row pgx.Row) error {
		var err error
		sg, err = scanSaga(row)
		return err
	}, pguuid.Of(r.SagaID))
	t.queue(selectStep, func(row pgx.Row) error {
		err := row.Scan(&st.index, &phase, &status, &st.attempt)
		if errors.Is(err, pgx.ErrNoRows) {
			stepFound = false
			return nil
		}
		if err != nil {
			return fmt.Errorf("read step: %w", err)
		}
		return nil
	}, stepID{r.SagaID, r.Step, r.Phase}.args()...)
	if err := t.flush(ctx); errors.Is(err, saga.ErrNotFound) {
		return VerdictMissing, nil
	} else if err != nil {
		return "", err
	}
	if !stepFound {
		return VerdictMissing, nil
	}
	st.phase, st.status = saga.Phase(phase), saga.StepStatus(status)
	v := judge(st, r)
	if v != VerdictApplied {
		return v, nil
	}
	return v, c.apply(ctx, t, sg, def, idx, r, fx)
}

func (c *core) apply(ctx context.Context, tx *txn, sg *saga.Instance, def *saga.Definition, idx int, r wire.Reply, fx *effects) error {
	policy := policyOf(def, idx, r.Phase)
	switch {
	case r.Outcome == wire.OutcomeSucceeded:
		return c.succeed(tx, sg, def, idx, r.Phase, r.Attempt, r.Result, fx)

	case r.Outcome == wire.OutcomeRetry && r.Attempt < policy.MaxAttempts:
		delay := policy.Backoff(r.Attempt)
		if r.RetryAfterMillis > 0 {
			delay = time.Duration(r.RetryAfterMillis) * time.Millisecond
		}
		tx.queue(scheduleRetry, func(row pgx.Row) error {
			var ok int
			if err := row.Scan(&ok); err != nil {
				return fmt.Errorf("schedule a retry of step %s: %w", r.Key, err)
			}
			return nil
		}, stepID{r.SagaID, r.Step, r.Phase}.args(r.Attempt, r.Error, delay.Milliseconds())...)
		fx.retries = append(fx.retries, [3]string{def.Name(), r.Step, string(r.Phase)})
		return nil

	case r.Outcome == wire.OutcomeRetry:
		reason := fmt.Sprintf("%d attempts exhausted; last error: %s", r.Attempt, r.Error)
		return c.abandon(ctx, tx, sg, def, idx, r.Phase, r.Attempt, reason, fx)

	default: // a permanent failure
		return c.abandon(ctx, tx, sg, def, idx, r.Phase, r.Attempt, r.Error, fx)
	}
}

// finishStep queues a step's outcome, fenced by its attempt.
func (c *core) finishStep(tx *txn, id stepID, attempt int, status saga.StepStatus, result []byte, errText string) {
	var e any
	if errText != "" {
		e = errText
	}
	tx.queue(finishStep, func(row pgx.Row) error {
		var ok int
		if err := row.Scan(&ok); err != nil {
			return fmt.Errorf("record the outcome of step %q (%s) of saga %s: %w", id.step, id.phase, id.saga, err)
		}
		return nil
	}, id.args(attempt, status, nullJSON(result), e, string(status))...)
}

// handleReplyMsg is the orchestrator's JetStream handler: apply, then ack.
func (c *core) handleReplyMsg(ctx context.Context, msg jetstream.Msg) {
	r, err := wire.DecodeReply(msg.Data())
	if err != nil {
		c.log.Error("orchestrator: dropping undecodable reply", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	v, err := c.ApplyReply(ctx, r)
	if err != nil {
		c.log.Warn("orchestrator: reply not applied; it will be redelivered",
			"saga_id", r.SagaID, "step", r.Step, "phase", r.Phase, "attempt", r.Attempt, "error", err)
		_ = msg.NakWithDelay(200 * time.Millisecond)
		return
	}
	c.metrics.Deliveries.WithLabelValues(metrics.LayerOrchestrator).Inc()
	switch v {
	case VerdictDuplicate:
		c.metrics.Duplicates.WithLabelValues(metrics.LayerOrchestrator).Inc()
	case VerdictStale:
		c.metrics.StaleReplies.WithLabelValues(r.Definition, r.Step, string(r.Phase)).Inc()
	case VerdictMissing:
		c.log.Warn("orchestrator: reply for a saga or step that does not exist; dropped", "saga_id", r.SagaID, "step", r.Step)
	}
	if err := failpoint.Inject(failpoint.OrchestratorBeforeAck); err != nil {
		return // as if the ack was lost: JetStream redelivers after AckWait
	}
	_ = msg.Ack()
}

// applyInStep applies a step's success to its saga inside the step
// worker's own transaction (steps.Config.ApplyFunc), so the success needs
// no reply, no second transaction and no trip through the broker. The
// saga is locked after the step's business writes, in the order every
// writer takes (saga, then step); what the engine gives up on it settles
// through the inbox with a lock timeout, so it cannot wait on a step
// forever. a.Pending holds the step's writes not yet sent. The writes
// returned are the step worker's to commit.
//
// With a.Guess and a command that says which state and version of the
// saga it was written at, nothing is read: the success is applied to that
// state, every write fenced (the saga by its state and version, the step
// by its attempt), and the whole success costs one round trip. A saga that
// moved meanwhile fails the batch, and the worker asks again without
// a.Guess: then the saga is locked and read, and the success judged as a
// reply would be.
func (c *core) applyInStep(ctx context.Context, a steps.Apply) (steps.Applied, error) {
	r := a.Reply
	def, err := c.definition(r.Definition)
	if err != nil {
		return steps.Applied{}, err
	}
	idx := def.StepIndex(r.Step)
	if idx < 0 {
		return steps.Applied{}, fmt.Errorf("definition %q has no step %q; deploy the same definition everywhere", r.Definition, r.Step)
	}
	if a.Guess && a.Command.Version > 0 && r.Outcome == wire.OutcomeSucceeded {
		if res, ok := c.guessInStep(a, def, idx); ok {
			return res, nil
		}
	}
	c.metrics.InStepReads.WithLabelValues(r.Definition, r.Step).Inc()
	fx := &effects{}
	t := inTxn(a.Conn, a.Pending)
	v, err := c.judgeAndQueue(ctx, t, def, idx, r, fx)
	if err != nil {
		return steps.Applied{}, err
	}
	switch v {
	case VerdictApplied:
	case VerdictStale:
		// Counted once the step's transaction commits.
		return steps.Applied{After: func() { c.metrics.StaleReplies.WithLabelValues(r.Definition, r.Step, string(r.Phase)).Inc() }}, nil
	default:
		return steps.Applied{}, nil
	}
	return steps.Applied{Writes: t.pending(), After: func() {
		fx.sent = t.sent
		c.emit(fx)
	}}, nil
}

// guessInStep queues a success's writes as if the saga were still at the
// state and version its command was written at: the command carries the
// saga's input and results of that version, which is all the next command
// needs. The saga is locked first (saga, then step, as every writer): a
// forward success is one statement (succeedForward) whose transition
// comes first, a compensation takes the lock with a statement of its own;
// each raises if the saga or the step moved. It reports false, with a.Pending as it was, when
// the writes cannot be built.
func (c *core) guessInStep(a steps.Apply, def *saga.Definition, idx int) (steps.Applied, bool) {
	cmd, r := a.Command, a.Reply
	sg := &saga.Instance{
		ID: cmd.SagaID, Definition: cmd.Definition, State: cmd.State, Version: cmd.Version,
		Input: cmd.Input, Results: maps.Clone(cmd.Results),
	}
	queued := len(a.Pending.QueuedQueries)
	fx := &effects{}
	t := inTxn(a.Conn, a.Pending)
	if r.Phase == saga.PhaseCompensate {
		// A compensation may move the saga on without a transition (to
		// the next compensation): lock it first. A forward success's
		// transition, queued first, is its lock.
		t.queue(lockSagaAt, func(row pgx.Row) error {
			var ok int
			if err := row.Scan(&ok, &sg.CreatedAt); err != nil {
				return fmt.Errorf("lock saga %s at version %d: %w", sg.ID, sg.Version, err)
			}
			return nil
		}, pguuid.Of(sg.ID), string(sg.State), sg.Version)
	}
	var err error
	if r.Phase == saga.PhaseForward {
		err = c.succeedGuessed(t, sg, def, idx, r.Attempt, r.Result, fx)
	} else {
		err = c.succeed(t, sg, def, idx, r.Phase, r.Attempt, r.Result, fx)
	}
	if err != nil {
		c.log.Debug("orchestrator: cannot apply a success as its command foresaw; reading the saga", "saga_id", sg.ID, "step", r.Step, "error", err)
		a.Pending.QueuedQueries = a.Pending.QueuedQueries[:queued]
		return steps.Applied{}, false
	}
	return steps.Applied{Writes: t.pending(), Guessed: true, After: func() {
		fx.sent = t.sent
		c.emit(fx)
	}}, true
}
