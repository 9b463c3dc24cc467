package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// errAlreadyApplied reports a transition whose target state the saga is
// already in: a duplicate, to be treated as success.
var errAlreadyApplied = errors.New("idemsaga: transition already applied")

// core is what the client, the orchestrator and the reaper share.
type core struct {
	pool       *pgxpool.Pool
	defs       map[string]*saga.Definition
	subjects   wire.Subjects
	leaseGrace time.Duration
	maxInput   int
	metrics    *metrics.Metrics
	log        *slog.Logger
	// notify wakes the local relay after a commit that wrote the outbox.
	notify func()
	// publish, if set, publishes the outbox rows this process committed,
	// right after the commit (outbox.Relay.Publish); the relay's sweep
	// takes them over only after handOff. Without it the rows are the
	// relay's at once.
	publish func(rows ...outbox.Committed)
	handOff time.Duration
	// publishing reports whether the local relay runs, and so whether
	// publish will publish; rows written while it does not are the
	// relay's at once, wherever one runs.
	publishing func() bool
	// onFinished is Config.OnFinishedFunc.
	onFinished func(id uuid.UUID, definition string, state saga.State)
}

func (c *core) definition(name string) (*saga.Definition, error) {
	d, ok := c.defs[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", saga.ErrUnknownDefinition, name)
	}
	return d, nil
}

func (c *core) woke() {
	if c.notify != nil {
		c.notify()
	}
}

// handOffArg is the publish_after parameter of the engine's outbox
// inserts: the hand-off in milliseconds when this process publishes its
// rows after commit, NULL (the relay's at once) when it does not.
func (c *core) handOffArg() any {
	if c.publish == nil || (c.publishing != nil && !c.publishing()) {
		return nil
	}
	return c.handOff.Milliseconds()
}

// sent publishes rows a transaction committed, or wakes the relay to.
func (c *core) sent(rows []outbox.Committed) {
	if len(rows) == 0 {
		return
	}
	if c.publish != nil {
		c.publish(rows...)
		return
	}
	c.woke()
}

// effects are observed after a transaction commits.
type effects struct {
	finished []finished
	// retries holds (definition, step, phase) of retries scheduled.
	retries [][3]string
	// sent holds the outbox rows the transaction wrote.
	sent []outbox.Committed
}

type finished struct {
	id         uuid.UUID
	state      saga.State
	definition string
	outcome    string
	// created is the saga's start, read at emit: a success applied
	// without reading the saga first learns it from its lock statement.
	created *time.Time
}

func (c *core) emit(fx *effects) {
	for _, r := range fx.retries {
		c.metrics.RetriesScheduled.WithLabelValues(r[0], r[1], r[2]).Inc()
	}
	for _, f := range fx.finished {
		c.metrics.SagasFinished.WithLabelValues(f.definition, f.outcome).Inc()
		c.metrics.SagaDuration.WithLabelValues(f.definition, f.outcome).Observe(time.Since(*f.created).Seconds())
		if c.onFinished != nil {
			c.onFinished(f.id, f.definition, f.state)
		}
	}
	c.sent(fx.sent)
}

type queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func scanSaga(row pgx.Row) (*saga.Instance, error) {
	var s saga.Instance
	var state string
	var results map[string]json.RawMessage
	err := row.Scan(&s.ID, &s.Definition, &s.Key, &state, &s.Version, &s.Input, &results, &s.Error,
		&s.CreatedAt, &s.UpdatedAt, &s.FinishedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, saga.ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("read saga: %w", err)
	}
	s.State, s.Results = saga.State(state), results
	return &s, nil
}

func loadSaga(ctx context.Context, q queryer, id uuid.UUID, lock bool) (*saga.Instance, error) {
	sql := selectSagaByID
	if lock {
		sql = selectSagaByIDLocked
	}
	return scanSaga(q.QueryRow(ctx, sql, id))
}

// transition moves sg from its current state and version to `to`, in one
// conditional update queued on tx. When no row matches, the flush fails
// with the reason (checkError): already there (errAlreadyApplied), moved
// elsewhere (saga.ErrConflict), gone (saga.ErrNotFound). sg is updated in place at
// once, so that later writes of the same transaction see the new state;
// if the flush fails the caller rolls back and drops sg.
func (c *core) transition(tx *txn, sg *saga.Instance, to saga.State, fin bool, errText *string, resultStep *string, result json.RawMessage, fx *effects) error {
	def, err := c.definition(sg.Definition)
	if err != nil {
		return err
	}
	if !def.CanTransition(sg.State, to) {
		return fmt.Errorf("idemsaga: saga %s cannot move from %q to %q", sg.ID, sg.State, to)
	}
	id := sg.ID
	tx.queue(transitionSaga, func(row pgx.Row) error {
		var ok int
		if err := row.Scan(&ok, &sg.CreatedAt); err != nil {
			return fmt.Errorf("transition saga %s to %q: %w", id, to, err)
		}
		return nil
	}, pguuid.Of(sg.ID), sg.State, to, fin, errText, resultStep, nullJSON(result), sg.Version)
	moved(sg, to, fin, resultStep, result, fx)
	return nil
}

// moved updates sg in place for a transition queued, so that later writes
// of the same transaction see the new state.
func moved(sg *saga.Instance, to saga.State, fin bool, resultStep *string, result json.RawMessage, fx *effects) {
	sg.State, sg.Version = to, sg.Version+1
	if resultStep != nil {
		if sg.Results == nil {
			sg.Results = map[string]json.RawMessage{}
		}
		if len(result) == 0 {
			result = json.RawMessage("null")
		}
		sg.Results[*resultStep] = result
	}
	if fin {
		outcome := "completed"
		if to == saga.StateCompensated || to == saga.StateFailed {
			outcome = string(to)
		}
		fx.finished = append(fx.finished, finished{id: sg.ID, state: to, definition: sg.Definition, outcome: outcome, created: &sg.CreatedAt})
	}
}

// classifyMiss explains a conditional update that touched no row.
func classifyMiss(ctx context.Context, q queryer, id uuid.UUID, to saga.State) error {
	var state string
	var version int64
	err := q.QueryRow(ctx, probeSaga, id).Scan(&state, &version)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %s", saga.ErrNotFound, id)
	case err != nil:
		return fmt.Errorf("re-read saga %s: %w", id, err)
	case saga.State(state) == to:
		return errAlreadyApplied
	default:
		return fmt.Errorf("%w: saga %s is now %q at version %d", saga.ErrConflict, id, state, version)
	}
}

func (c *core) leaseMillis(p saga.RetryPolicy) int64 {
	return (p.Timeout + c.leaseGrace).Milliseconds()
}

func policyOf(def *saga.Definition, idx int, phase saga.Phase) saga.RetryPolicy {
	if phase == saga.PhaseCompensate {
		return def.Step(idx).CompensateRetry
	}
	return def.Step(idx).Retry
}

// commandMessage encodes the command of one attempt.
func (c *core) commandMessage(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int) (subject, msgID string, payload []byte, err error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	cmd := wire.Command{
		SagaID: sg.ID, Definition: sg.Definition, Step: step.Name, Phase: phase,
		Key: key, Attempt: attempt, Input: sg.Input, Results: sg.Results,
		State: sg.State, Version: sg.Version,
	}
	payload, err = json.Marshal(cmd)
	if err != nil {
		return "", "", nil, fmt.Errorf("encode command: %w", err)
	}
	return c.subjects.Command(sg.Definition, step.Name), "c-" + saga.MessageID(key, attempt), payload, nil
}

// command queues the outbox row of one attempt.
func (c *core) command(tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int) error {
	subject, msgID, payload, err := c.commandMessage(sg, def, idx, phase, attempt)
	if err != nil {
		return err
	}
	tx.queue(insertCommand, func(row pgx.Row) error {
		var id int64
		if err := row.Scan(&id); err != nil {
			return fmt.Errorf("outbox: insert command %s: %w", msgID, err)
		}
		tx.sent = append(tx.sent, outbox.Committed{ID: id, Subject: subject, MsgID: msgID, Payload: payload})
		return nil
	}, subject, msgID, payload, pguuid.Of(sg.ID), c.handOffArg())
	return nil
}

// dispatch queues attempt 1 of a step with its command. If the step
// exists already, its command is already out and nothing is written.
func (c *core) dispatch(tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) error {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	subject, msgID, payload, err := c.commandMessage(sg, def, idx, phase, 1)
	if err != nil {
		return err
	}
	id := sg.ID
	tx.queue(dispatchStep, func(row pgx.Row) error {
		var out *int64
		if err := row.Scan(&out); err != nil {
			return fmt.Errorf("dispatch step %q (%s) of saga %s: %w", step.Name, phase, id, err)
		}
		if out != nil {
			tx.sent = append(tx.sent, outbox.Committed{ID: *out, Subject: subject, MsgID: msgID, Payload: payload})
		}
		return nil
	}, pguuid.Of(sg.ID), step.Name, phase, idx, pguuid.Of(key), c.leaseMillis(policyOf(def, idx, phase)), subject, msgID, payload, c.handOffArg())
	return nil
}

// redispatch starts the next attempt of a step, fenced by the attempt the
// caller saw. It reports false when another writer moved the step first.
func (c *core) redispatch(ctx context.Context, tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, seenAttempt int) (bool, error) {
	id := stepID{sg.ID, def.Step(idx).Name, phase}
	q, err := tx.read(ctx)
	if err != nil {
		return false, err
	}
	var attempt int
	err = q.QueryRow(ctx, redispatchStep, id.args(seenAttempt, c.leaseMillis(policyOf(def, idx, phase)))...).Scan(&attempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("redispatch: %w", err)
	}
	return true, c.command(tx, sg, def, idx, phase, attempt)
}

// succeed records a step's success and moves the saga on: to the next
// forward step or the final state, or to the next compensation.
func (c *core) succeed(tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int, result json.RawMessage, fx *effects) error {
	id := stepID{sg.ID, def.Step(idx).Name, phase}
	if phase == saga.PhaseCompensate {
		c.finishStep(tx, id, attempt, saga.StepSucceeded, result, "")
		return c.compensateNext(tx, sg, def, idx, fx)
	}
	step := def.Step(idx)
	last := idx == def.Len()-1
	// The saga, then the step: the order every writer locks them in. A
	// success applied without reading the saga first (guessInStep) takes
	// the saga's lock here.
	if err := c.transition(tx, sg, step.Reaches, last, nil, &step.Name, result, fx); err != nil {
		return err
	}
	c.finishStep(tx, id, attempt, saga.StepSucceeded, result, "")
	if last {
		return nil
	}
	return c.dispatch(tx, sg, def, idx+1, saga.PhaseForward)
}

// succeedGuessed queues a forward step's success as one statement
// (succeedForward, or succeedLast), for a saga assumed to be where sg says: its state and
// version fence the transition, and the attempt fences the step. A saga or
// step that moved meanwhile fails the statement.
func (c *core) succeedGuessed(tx *txn, sg *saga.Instance, def *saga.Definition, idx int, attempt int, result json.RawMessage, fx *effects) error {
	step := def.Step(idx)
	last := idx == def.Len()-1
	if !def.CanTransition(sg.State, step.Reaches) {
		return fmt.Errorf("idemsaga: saga %s cannot move from %q to %q", sg.ID, sg.State, step.Reaches)
	}
	args := []any{pguuid.Of(sg.ID), string(sg.State), string(step.Reaches), last, step.Name, nullJSON(result), sg.Version, attempt}
	moved(sg, step.Reaches, last, &step.Name, result, fx)
	var subject, msgID string
	var payload []byte
	sql := succeedLast
	if !last {
		sql = succeedForward
		next := def.Step(idx + 1)
		var err error
		if subject, msgID, payload, err = c.commandMessage(sg, def, idx+1, saga.PhaseForward, 1); err != nil {
			return err
		}
		args = append(args, next.Name, idx+1, pguuid.Of(saga.StepKey(sg.ID, next.Name, saga.PhaseForward)),
			c.leaseMillis(policyOf(def, idx+1, saga.PhaseForward)), subject, msgID, payload, c.handOffArg())
	}
	id := sg.ID
	tx.queue(sql, func(row pgx.Row) error {
		var ok int
		var out *int64
		if err := row.Scan(&ok, &sg.CreatedAt, &out); err != nil {
			return fmt.Errorf("apply the success of step %q to saga %s: %w", step.Name, id, err)
		}
		if out != nil {
			tx.sent = append(tx.sent, outbox.Committed{ID: *out, Subject: subject, MsgID: msgID, Payload: payload})
		}
		return nil
	}, args...)
	return nil
}

// abandon gives a step up (a permanent failure, retries exhausted, or the
// last lease expired with no reply). It first settles the step through the
// inbox: a tombstone under its key makes every later delivery of its
// command a no-op, and whatever the inbox already holds is the truth. If
// the step did take effect (a success whose reply was lost, or is still on
// its way), it is applied as a success; otherwise a forward step starts
// compensation of the steps before it and a compensation ends the saga in
// StateFailed.
func (c *core) abandon(ctx context.Context, tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int, reason string, fx *effects) error {
	step := def.Step(idx)
	outcome, result, err := c.settle(ctx, tx, sg, def, idx, phase)
	if err != nil {
		return err
	}
	if outcome == "succeeded" {
		c.log.Info("step given up had taken effect; applied as a success", "saga_id", sg.ID, "step", step.Name, "phase", phase, "attempt", attempt)
		return c.succeed(tx, sg, def, idx, phase, attempt, result, fx)
	}
	c.finishStep(tx, stepID{sg.ID, step.Name, phase}, attempt, saga.StepFailed, nil, reason)
	if phase == saga.PhaseCompensate {
		return c.giveUp(tx, sg, def, idx, reason, fx)
	}
	return c.compensate(tx, sg, def, idx, reason, fx)
}

// settle tombstones a step's key in the inbox (so no delivery can take
// effect after this transaction) and returns what the inbox holds for it:
// "succeeded" with the result if the step did take effect.
func (c *core) settle(ctx context.Context, tx *txn, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) (string, []byte, error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	q, err := tx.read(ctx)
	if err != nil {
		return "", nil, err
	}
	b := &pgx.Batch{}
	b.Queue(settleLockTimeout)
	b.Queue(settleTombstone, key, sg.ID, step.Name, phase)
	var outcome string
	var result []byte
	b.Queue(settleRead, sg.ID, key).QueryRow(func(row pgx.Row) error { return row.Scan(&outcome, &result) })
	if err := q.SendBatch(ctx, b).Close(); err != nil {
		return "", nil, fmt.Errorf("settle step %q (%s) of saga %s through the inbox: %w", step.Name, phase, sg.ID, err)
	}
	return outcome, result, nil
}

// compensate starts rolling back after forward step failedIdx failed and
// was settled as not having taken effect.
func (c *core) compensate(tx *txn, sg *saga.Instance, def *saga.Definition, failedIdx int, reason string, fx *effects) error {
	msg := fmt.Sprintf("step %q failed: %s", def.Step(failedIdx).Name, reason)
	if err := c.transition(tx, sg, saga.StateCompensating, false, &msg, nil, nil, fx); err != nil {
		return err
	}
	plan := compensation.Plan(def, failedIdx)
	if len(plan) == 0 {
		return c.transition(tx, sg, saga.StateCompensated, true, nil, nil, nil, fx)
	}
	return c.dispatch(tx, sg, def, plan[0], saga.PhaseCompensate)
}

// compensateNext continues the rollback after step doneIdx was compensated.
func (c *core) compensateNext(tx *txn, sg *saga.Instance, def *saga.Definition, doneIdx int, fx *effects) error {
	next := compensation.Next(def, doneIdx)
	if next < 0 {
		return c.transition(tx, sg, saga.StateCompensated, true, nil, nil, nil, fx)
	}
	return c.dispatch(tx, sg, def, next, saga.PhaseCompensate)
}

// giveUp ends a saga whose compensation cannot finish.
func (c *core) giveUp(tx *txn, sg *saga.Instance, def *saga.Definition, idx int, reason string, fx *effects) error {
	msg := fmt.Sprintf("compensation of step %q cannot finish: %s; a person must repair the effects and then retry or close the saga", def.Step(idx).Name, reason)
	return c.transition(tx, sg, saga.StateFailed, true, &msg, nil, nil, fx)
}

func nullJSON(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return []byte(b)
}
