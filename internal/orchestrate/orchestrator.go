package orchestrate

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/idemsaga/idemsaga/internal/plan"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
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
	index        int
	phase        saga.Phase
	status       saga.StepStatus
	attempt      int
	possiblyDone bool
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
	case st.status == saga.StepWaiting:
		// Only its callback moves a waiting step; its own attempt's
		// outcome was applied when it began to wait.
		return VerdictDuplicate
	default:
		return VerdictApplied
	}
}

// ApplyReply records one reply in one transaction: the step's outcome, the
// saga's move and the next command. It is idempotent: a duplicate or
// stale reply changes nothing.
func (c *Core) ApplyReply(ctx context.Context, r wire.Reply) (v Verdict, err error) {
	if c.tracer.Enabled() {
		var sp tracing.Span
		ctx, sp = c.tracer.StartReply(ctx, r.Trace, tracing.Attempt{Saga: r.SagaID, Definition: r.Definition, Step: r.Step, Phase: string(r.Phase), Attempt: r.Attempt})
		sp.SetAttributes(tracing.AttrReason.String(string(r.Outcome)))
		defer func() { sp.End(string(v), err) }()
	}
	def, idx, err := c.stepAt(ctx, r.Definition, r.DefinitionVersion, r.Step)
	if err != nil {
		return "", err
	}
	fx := &effects{}
	v, err = c.applyReply(ctx, def, idx, r, fx)
	if err == nil && v == VerdictApplied {
		// After the connection went back to the pool: OnFinishedFunc may
		// use the pool itself.
		c.emit(fx)
	}
	return v, err
}

func (c *Core) applyReply(ctx context.Context, def *saga.Definition, idx int, r wire.Reply, fx *effects) (Verdict, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return "", fmt.Errorf("acquire a connection: %w", err)
	}
	defer conn.Release()
	tx := store.Begin(conn.Conn(), c.schema)
	defer tx.Rollback(ctx)
	tx.SetTrace(c.tracer.Headers(ctx))

	// First round trip: BEGIN, lock the saga (the order every writer
	// takes: saga, then step), read the step. Last: the writes and COMMIT.
	var sg *saga.Instance
	var st stepRow
	var phase, status string
	stepFound := true
	tx.Queue(store.SelectSagaByIDLocked, func(row pgx.Row) error {
		var err error
		sg, err = store.ScanSaga(row)
		if errors.Is(err, saga.ErrNotFound) {
			return nil
		}
		return err
	}, pguuid.Of(r.SagaID))
	tx.Queue(store.SelectStep, func(row pgx.Row) error {
		err := row.Scan(&st.index, &phase, &status, &st.attempt, &st.possiblyDone)
		if errors.Is(err, pgx.ErrNoRows) {
			stepFound = false
			return nil
		}
		if err != nil {
			return fmt.Errorf("read step: %w", err)
		}
		return nil
	}, pguuid.Of(r.SagaID), r.Step, string(r.Phase))
	if err := tx.Flush(ctx); err != nil {
		return "", err
	}
	if sg == nil || !stepFound {
		return VerdictMissing, nil
	}
	if sg.DefinitionVersion != def.Version() {
		// No command of the saga names another version: the reply is
		// not one of its attempts'.
		c.log.Warn("orchestrator: a reply names another definition version than its saga runs; ignored as stale",
			"saga_id", sg.ID, "reply_version", def.Ref(), "saga_version", saga.Ref(sg.Definition, sg.DefinitionVersion))
		return VerdictStale, nil
	}
	st.phase, st.status = saga.Phase(phase), saga.StepStatus(status)
	if r.Outcome == wire.OutcomeWaiting && r.Attempt < st.attempt && (st.status == saga.StepDispatched || st.status == saga.StepRetrying) {
		// The request of an older attempt was accepted after the step's
		// lease had been taken over: its key waits, so no later attempt
		// can claim it (its claim found the key waiting), and the step
		// waits for its callback at the attempt it is at.
		r.Attempt = st.attempt
	}
	v := judge(st, r)
	if v != VerdictApplied {
		return v, nil
	}
	if err := c.withSteps(ctx, tx, sg, def); err != nil {
		return "", err
	}
	if err := c.apply(ctx, tx, sg, def, idx, st, r, fx); err != nil {
		return "", err
	}
	if err := tx.Commit(ctx); err != nil {
		return "", err
	}
	fx.sent = tx.Published()
	return VerdictApplied, nil
}

// apply queues the writes of an applicable reply on tx, which holds the
// saga's lock and read sg and st.
func (c *Core) apply(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, st stepRow, r wire.Reply, fx *effects) error {
	policy := plan.PolicyOf(def, idx, r.Phase)
	retryable := r.Outcome == wire.OutcomeRetry || r.Outcome == wire.OutcomeUnknown
	possiblyDone := st.possiblyDone || r.Outcome == wire.OutcomeUnknown
	switch {
	case r.Outcome == wire.OutcomeWaiting:
		return c.wait(ctx, tx, sg, def, idx, r.Phase, r.Attempt, fx)

	case r.Outcome == wire.OutcomeSucceeded:
		m, err := c.plan.Success(sg, def, idx, r.Phase, r.Attempt, r.Result)
		if err != nil {
			return err
		}
		store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
		return nil

	case retryable && r.Attempt < policy.MaxAttempts:
		delay := policy.Backoff(r.Attempt)
		if r.RetryAfterMillis > 0 {
			delay = time.Duration(r.RetryAfterMillis) * time.Millisecond
		}
		outcome := "retry"
		if r.Outcome == wire.OutcomeUnknown {
			outcome = "unknown"
		}
		tx.Queue(store.ScheduleRetry, func(row pgx.Row) error {
			var invariant *int
			if err := row.Scan(&invariant); err != nil {
				return fmt.Errorf("schedule a retry of step %s: %w", r.Key, err)
			}
			return nil
		}, pguuid.Of(r.SagaID), r.Step, string(r.Phase), r.Attempt, r.Error, delay.Milliseconds(), outcome, sg.Version)
		fx.retries = append(fx.retries, [3]string{def.Name(), r.Step, string(r.Phase)})
		return nil

	case retryable:
		if r.Outcome == wire.OutcomeUnknown {
			// The timeline keeps what the last attempt was, not only
			// that the step was given up after it.
			tx.Exec(store.MarkAttemptUnknown, nil, pguuid.Of(r.SagaID), r.Step, string(r.Phase), r.Attempt, r.Error)
		}
		return c.giveUpOrComplete(ctx, tx, sg, def, idx, r.Phase, r.Attempt, plan.Exhausted(r.Attempt, r.Error), possiblyDone, fx)

	default: // failed for good
		return c.giveUp(ctx, tx, sg, def, idx, r.Phase, r.Attempt, r.Error, possiblyDone, fx)
	}
}

// handleReplyMsg is the orchestrator's JetStream handler: apply, then ack.
func (c *Core) HandleReplyMsg(ctx context.Context, msg jetstream.Msg) {
	r, err := wire.DecodeReply(msg.Data())
	if err != nil {
		c.log.Error("orchestrator: dropping undecodable reply", "subject", msg.Subject(), "error", err)
		_ = msg.Term()
		return
	}
	if c.tracer.Enabled() {
		r.Trace = tracing.FromNATS(msg.Headers())
	}
	v, err := c.ApplyReply(ctx, r)
	if err != nil {
		lvl := c.log.Warn
		if errors.Is(err, store.ErrBusy) {
			lvl = c.log.Debug
		}
		lvl("orchestrator: reply not applied; it will be redelivered",
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

// Move is the engine's in-step decision (attempt.Mover): the move of an
// attempt's outcome, as if the saga were still at the state and version
// its command was written at. The command carries the saga's input and
// results of that version, which is all the next command needs. A
// success moves the saga on; a database step that failed for good (or on
// its last attempt) starts its compensation, its failure recorded in the
// inbox with it. The rest goes to the orchestrator as a reply: retries,
// and an external step's failures, which need what the inbox knows of its
// earlier attempts.
func (c *Core) Move(cmd wire.Command, kind saga.StepKind, o attempt.Outcome) (store.Move, bool) {
	if cmd.Version <= 0 {
		return store.Move{}, false
	}
	def, ok := c.local(cmd.Definition, cmd.DefVersion())
	if !ok {
		return store.Move{}, false
	}
	idx := def.StepIndex(cmd.Step)
	if idx < 0 {
		return store.Move{}, false
	}
	sg := &saga.Instance{ID: cmd.SagaID, Definition: cmd.Definition, DefinitionVersion: def.Version(), State: cmd.State, Version: cmd.Version,
		Input: cmd.Input, Results: maps.Clone(cmd.Results), Skipped: cmd.Skipped}
	var m *store.Move
	var err error
	switch {
	case o.Status == wire.OutcomeSucceeded:
		m, err = c.plan.Success(sg, def, idx, cmd.Phase, cmd.Attempt, o.Result)
	case kind != saga.DatabaseStep:
		return store.Move{}, false
	case o.Status == wire.OutcomeFailed:
		m, err = c.plan.Failure(sg, def, idx, cmd.Phase, cmd.Attempt, o.Error, compensation.NotDone)
	case o.Status == wire.OutcomeRetry && cmd.Attempt >= plan.PolicyOf(def, idx, cmd.Phase).MaxAttempts:
		m, err = c.plan.Failure(sg, def, idx, cmd.Phase, cmd.Attempt, plan.Exhausted(cmd.Attempt, o.Error), compensation.NotDone)
	default:
		return store.Move{}, false
	}
	if err != nil {
		c.log.Debug("step worker: an outcome cannot be applied as its command foresaw; answering with a reply",
			"saga_id", cmd.SagaID, "step", cmd.Step, "error", err)
		return store.Move{}, false
	}
	if len(m.Also) > 0 {
		// Several branches are dispatched under the saga's lock only.
		return store.Move{}, false
	}
	m.RecordFailure = m.Status == saga.StepFailed
	return *m, true
}
