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

// effects are observed after a transaction commits.
type effects struct {
	finished []finished
	// retries holds (definition, step, phase) of retries scheduled.
	retries [][3]string
}

type finished struct {
	id         uuid.UUID
	state      saga.State
	definition string
	outcome    string
	took       time.Duration
}

func (c *core) emit(fx *effects) {
	for _, r := range fx.retries {
		c.metrics.RetriesScheduled.WithLabelValues(r[0], r[1], r[2]).Inc()
	}
	for _, f := range fx.finished {
		c.metrics.SagasFinished.WithLabelValues(f.definition, f.outcome).Inc()
		c.metrics.SagaDuration.WithLabelValues(f.definition, f.outcome).Observe(f.took.Seconds())
		if c.onFinished != nil {
			c.onFinished(f.id, f.definition, f.state)
		}
	}
	c.woke()
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
// conditional update. When no row matches it tells apart: already there
// (errAlreadyApplied), moved elsewhere (saga.ErrConflict), gone
// (saga.ErrNotFound). On success sg is updated in place.
func (c *core) transition(ctx context.Context, tx pgx.Tx, sg *saga.Instance, to saga.State, fin bool, errText *string, resultStep *string, result json.RawMessage, fx *effects) error {
	def, err := c.definition(sg.Definition)
	if err != nil {
		return err
	}
	if !def.CanTransition(sg.State, to) {
		return fmt.Errorf("idemsaga: saga %s cannot move from %q to %q", sg.ID, sg.State, to)
	}
	var version int64
	err = tx.QueryRow(ctx, transitionSaga, sg.ID, sg.State, to, fin, errText, resultStep, nullJSON(result), sg.Version).Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return classifyMiss(ctx, tx, sg.ID, to)
	}
	if err != nil {
		return fmt.Errorf("transition saga %s to %q: %w", sg.ID, to, err)
	}
	sg.State, sg.Version = to, version
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
		fx.finished = append(fx.finished, finished{id: sg.ID, state: to, definition: sg.Definition, outcome: outcome, took: time.Since(sg.CreatedAt)})
	}
	return nil
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

// command writes the outbox row of one attempt.
func (c *core) command(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int) error {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	cmd := wire.Command{
		SagaID: sg.ID, Definition: sg.Definition, Step: step.Name, Phase: phase,
		Key: key, Attempt: attempt, Input: sg.Input, Results: sg.Results,
	}
	payload, err := json.Marshal(cmd)
	if err != nil {
		return fmt.Errorf("encode command: %w", err)
	}
	return outbox.Write(ctx, tx, outbox.Message{
		SagaID:  sg.ID,
		Subject: c.subjects.Command(sg.Definition, step.Name),
		MsgID:   "c-" + saga.MessageID(key, attempt),
		Payload: payload,
	})
}

// dispatch creates the step row for attempt 1 and enqueues its command.
func (c *core) dispatch(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) error {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	var inserted int
	if err := tx.QueryRow(ctx, insertStep, sg.ID, step.Name, phase, idx, key, c.leaseMillis(policyOf(def, idx, phase))).Scan(&inserted); err != nil {
		return fmt.Errorf("dispatch step %q (%s) of saga %s: %w", step.Name, phase, sg.ID, err)
	}
	if inserted == 0 {
		return nil // already dispatched: its command is already out
	}
	return c.command(ctx, tx, sg, def, idx, phase, 1)
}

// redispatch starts the next attempt of a step, fenced by the attempt the
// caller saw. It reports false when another writer moved the step first.
func (c *core) redispatch(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, seenAttempt int) (bool, error) {
	key := saga.StepKey(sg.ID, def.Step(idx).Name, phase)
	var attempt int
	err := tx.QueryRow(ctx, redispatchStep, key, seenAttempt, c.leaseMillis(policyOf(def, idx, phase))).Scan(&attempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("redispatch: %w", err)
	}
	return true, c.command(ctx, tx, sg, def, idx, phase, attempt)
}

// succeed records a step's success and moves the saga on: to the next
// forward step or the final state, or to the next compensation.
func (c *core) succeed(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int, result json.RawMessage, fx *effects) error {
	key := saga.StepKey(sg.ID, def.Step(idx).Name, phase)
	if err := c.finishStep(ctx, tx, key, attempt, saga.StepSucceeded, result, ""); err != nil {
		return err
	}
	if phase == saga.PhaseCompensate {
		return c.compensateNext(ctx, tx, sg, def, idx, fx)
	}
	step := def.Step(idx)
	last := idx == def.Len()-1
	if err := c.transition(ctx, tx, sg, step.Reaches, last, nil, &step.Name, result, fx); err != nil {
		return err
	}
	if last {
		return nil
	}
	return c.dispatch(ctx, tx, sg, def, idx+1, saga.PhaseForward)
}

// abandon gives a step up (a permanent failure, retries exhausted, or the
// last lease expired with no reply). It first settles the step through the
// inbox: a tombstone under its key makes every later delivery of its
// command a no-op, and whatever the inbox already holds is the truth. If
// the step did take effect (a success whose reply was lost, or is still on
// its way), it is applied as a success; otherwise a forward step starts
// compensation of the steps before it and a compensation ends the saga in
// StateFailed.
func (c *core) abandon(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int, reason string, fx *effects) error {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	outcome, result, err := c.settle(ctx, tx, sg, def, idx, phase)
	if err != nil {
		return err
	}
	if outcome == "succeeded" {
		c.log.Info("step given up had taken effect; applied as a success", "saga_id", sg.ID, "step", step.Name, "phase", phase, "attempt", attempt)
		return c.succeed(ctx, tx, sg, def, idx, phase, attempt, result, fx)
	}
	if err := c.finishStep(ctx, tx, key, attempt, saga.StepFailed, nil, reason); err != nil {
		return err
	}
	if phase == saga.PhaseCompensate {
		return c.giveUp(ctx, tx, sg, def, idx, reason, fx)
	}
	return c.compensate(ctx, tx, sg, def, idx, reason, fx)
}

// settle tombstones a step's key in the inbox (so no delivery can take
// effect after this transaction) and returns what the inbox holds for it:
// "succeeded" with the result if the step did take effect.
func (c *core) settle(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) (string, []byte, error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	b := &pgx.Batch{}
	b.Queue(settleLockTimeout)
	b.Queue(settleTombstone, key, sg.ID, step.Name, phase)
	var outcome string
	var result []byte
	b.Queue(settleRead, key).QueryRow(func(row pgx.Row) error { return row.Scan(&outcome, &result) })
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return "", nil, fmt.Errorf("settle step %q (%s) of saga %s through the inbox: %w", step.Name, phase, sg.ID, err)
	}
	return outcome, result, nil
}

// compensate starts rolling back after forward step failedIdx failed and
// was settled as not having taken effect.
func (c *core) compensate(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, failedIdx int, reason string, fx *effects) error {
	msg := fmt.Sprintf("step %q failed: %s", def.Step(failedIdx).Name, reason)
	if err := c.transition(ctx, tx, sg, saga.StateCompensating, false, &msg, nil, nil, fx); err != nil {
		return err
	}
	plan := compensation.Plan(def, failedIdx)
	if len(plan) == 0 {
		return c.transition(ctx, tx, sg, saga.StateCompensated, true, nil, nil, nil, fx)
	}
	return c.dispatch(ctx, tx, sg, def, plan[0], saga.PhaseCompensate)
}

// compensateNext continues the rollback after step doneIdx was compensated.
func (c *core) compensateNext(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, doneIdx int, fx *effects) error {
	next := compensation.Next(def, doneIdx)
	if next < 0 {
		return c.transition(ctx, tx, sg, saga.StateCompensated, true, nil, nil, nil, fx)
	}
	return c.dispatch(ctx, tx, sg, def, next, saga.PhaseCompensate)
}

// giveUp ends a saga whose compensation cannot finish.
func (c *core) giveUp(ctx context.Context, tx pgx.Tx, sg *saga.Instance, def *saga.Definition, idx int, reason string, fx *effects) error {
	msg := fmt.Sprintf("compensation of step %q cannot finish: %s; a person must repair the effects and then retry or close the saga", def.Step(idx).Name, reason)
	return c.transition(ctx, tx, sg, saga.StateFailed, true, &msg, nil, nil, fx)
}

func nullJSON(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return []byte(b)
}
