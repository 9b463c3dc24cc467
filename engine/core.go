package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// core is what the client, the orchestrator, the reaper and the engine's
// own step workers share.
type core struct {
	pool *pgxpool.Pool
	// defs are this process's definitions, the newest version of each
	// name; versions all of them, by name and version; remote those known
	// only by the deployment's record (Client.Definition); refs names
	// versions as "name@version".
	defs       map[string]*saga.Definition
	versions   map[defKey]*saga.Definition
	refs       []string
	remote     described
	subjects   wire.Subjects
	leaseGrace time.Duration
	maxInput   int
	metrics    *metrics.Metrics
	log        *slog.Logger
	// tracer is Config.TracerProvider's; nil traces nothing.
	tracer *tracing.Tracer
	// out takes the outbox rows the core's transactions commit; nil for a
	// client that runs no worker (the rows are the relay's at once).
	out handOff
	// onFinished is Config.OnFinishedFunc.
	onFinished func(id uuid.UUID, definition string, state saga.State)
}

// handOffArg is the publish_after parameter of the core's outbox inserts
// (handOff.PublishAfter), NULL for a client that runs no worker.
func (c *core) handOffArg() any {
	if c.out == nil {
		return nil
	}
	return c.out.PublishAfter()
}

// sent hands rows a transaction committed to the hand-off.
func (c *core) sent(rows []outbox.Committed) {
	if c.out != nil {
		c.out.Committed(rows)
	}
}

// effects are observed after a transaction commits.
type effects struct {
	// moves holds the moves applied, with when their saga started.
	moves   []*store.Move
	created []*time.Time
	// retries holds (definition, step, phase) of retries scheduled.
	retries [][3]string
	// sent holds the outbox rows the transaction wrote.
	sent []outbox.Committed
}

// moved records a move queued on a transaction.
func (fx *effects) moved(m *store.Move) *time.Time {
	t := new(time.Time)
	fx.moves, fx.created = append(fx.moves, m), append(fx.created, t)
	return t
}

func (c *core) emit(fx *effects) {
	for _, r := range fx.retries {
		c.metrics.RetriesScheduled.WithLabelValues(r[0], r[1], r[2]).Inc()
	}
	for i, m := range fx.moves {
		c.Moved(m, *fx.created[i])
	}
	c.sent(fx.sent)
}

// Moved reports a move that committed: a saga that finished is counted,
// timed and handed to Config.OnFinishedFunc (attempt.Mover).
func (c *core) Moved(m *store.Move, created time.Time) {
	if !m.Finished {
		return
	}
	c.metrics.SagasFinished.WithLabelValues(m.Definition, m.Outcome).Inc()
	if !created.IsZero() {
		c.metrics.SagaDuration.WithLabelValues(m.Definition, m.Outcome).Observe(time.Since(created).Seconds())
	}
	if c.onFinished != nil {
		c.onFinished(m.Saga, m.Definition, m.To)
	}
}

type queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func scanSaga(row pgx.Row) (*saga.Instance, error) {
	var s saga.Instance
	var state string
	var results map[string]json.RawMessage
	err := row.Scan(&s.ID, &s.Definition, &s.Key, &state, &s.Version, &s.Input, &results, &s.Error,
		&s.CreatedAt, &s.UpdatedAt, &s.FinishedAt, &s.DefinitionVersion)
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
	sql := store.SelectSagaByID
	if lock {
		sql = store.SelectSagaByIDLocked
	}
	return scanSaga(q.QueryRow(ctx, sql, pguuid.Of(id)))
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

// commandMessage encodes the command of one attempt. sg is the saga as the
// transaction that writes the command leaves it: the command carries its
// state and version, so that a success can be applied in its step without
// a read.
func (c *core) commandMessage(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attempt int) (subject, msgID string, payload []byte, err error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	cmd := wire.Command{
		SagaID: sg.ID, Definition: sg.Definition, DefinitionVersion: def.Version(), Step: step.Name, Phase: phase,
		Key: key, Attempt: attempt, Input: sg.Input, Results: sg.Results,
		State: sg.State, Version: sg.Version,
	}
	payload, err = json.Marshal(cmd)
	if err != nil {
		return "", "", nil, fmt.Errorf("encode command: %w", err)
	}
	return c.subjects.Command(sg.Definition, step.Name), "c-" + saga.MessageID(key, attempt), payload, nil
}

// dispatch describes attempt 1 of step idx in the given phase, its command
// written from after, the saga as the dispatching move leaves it.
func (c *core) dispatch(after *saga.Instance, def *saga.Definition, idx int, phase saga.Phase) (*store.Dispatch, error) {
	subject, msgID, payload, err := c.commandMessage(after, def, idx, phase, 1)
	if err != nil {
		return nil, err
	}
	name := def.Step(idx).Name
	return &store.Dispatch{
		Step: name, Phase: phase, Index: idx, Key: saga.StepKey(after.ID, name, phase),
		LeaseMillis: c.leaseMillis(policyOf(def, idx, phase)), Subject: subject, MsgID: msgID, Payload: payload,
	}, nil
}

// moveFrom starts a move of sg, as it is now, to `to`; after is sg as the
// move leaves it, for the next command.
func moveFrom(sg *saga.Instance, to saga.State, step string, phase saga.Phase, attemptNo int) (*store.Move, *saga.Instance) {
	m := &store.Move{Saga: sg.ID, Definition: sg.Definition, From: sg.State, Version: sg.Version, To: to,
		Step: step, Phase: phase, Attempt: attemptNo}
	after := *sg
	after.State, after.Version = to, sg.Version+1
	return m, &after
}

// finish marks m as finishing its saga in state to.
func finish(m *store.Move, outcome string) {
	m.Finished, m.Outcome = true, outcome
}

// successMove is the move of a step's success: a forward step moves the
// saga to its state and dispatches the next (or finishes the saga); a
// compensation dispatches the next compensation (or ends compensated).
func (c *core) successMove(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, result json.RawMessage) (*store.Move, error) {
	step := def.Step(idx)
	if phase == saga.PhaseCompensate {
		next := compensation.Next(def, idx)
		to := saga.StateCompensating
		if next < 0 {
			to = saga.StateCompensated
		}
		if sg.State != saga.StateCompensating {
			return nil, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot take the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		m, after := moveFrom(sg, to, step.Name, phase, attemptNo)
		m.Status, m.StepResult = saga.StepSucceeded, result
		if next < 0 {
			finish(m, string(saga.StateCompensated))
			return m, nil
		}
		var err error
		m.Next, err = c.dispatch(after, def, next, saga.PhaseCompensate)
		return m, err
	}
	if !def.CanTransition(sg.State, step.Reaches) {
		return nil, fmt.Errorf("idemsaga: saga %s cannot move from %q to %q", sg.ID, sg.State, step.Reaches)
	}
	m, after := moveFrom(sg, step.Reaches, step.Name, phase, attemptNo)
	m.Status, m.StepResult = saga.StepSucceeded, result
	m.ResultStep, m.Result = step.Name, result
	if idx == def.Len()-1 {
		finish(m, "completed")
		return m, nil
	}
	after.Results = maps.Clone(sg.Results)
	if after.Results == nil {
		after.Results = map[string]json.RawMessage{}
	}
	if len(result) == 0 {
		result = json.RawMessage("null")
	}
	after.Results[step.Name] = result
	var err error
	m.Next, err = c.dispatch(after, def, idx+1, saga.PhaseForward)
	return m, err
}

// failureMove is the move of a step given up with reason: a forward step
// compensates the steps before it in reverse order, itself first when it
// is possibly done; a possibly-done step without a compensation parks the
// saga; a compensation that cannot finish ends the saga failed.
func (c *core) failureMove(sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, effect compensation.Effect) (*store.Move, error) {
	step := def.Step(idx)
	key := saga.StepKey(sg.ID, step.Name, phase)
	possibly := effect == compensation.PossiblyDone
	if phase == saga.PhaseCompensate {
		if sg.State != saga.StateCompensating {
			return nil, fmt.Errorf("idemsaga: saga %s is %q, not compensating; it cannot fail the compensation of step %q", sg.ID, sg.State, step.Name)
		}
		m, _ := moveFrom(sg, saga.StateFailed, step.Name, phase, attemptNo)
		m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
		how := ""
		if possibly {
			how = " (it may have taken effect: an attempt's outcome is unknown)"
		}
		m.Error = fmt.Sprintf("compensation of step %q (key %s) cannot finish%s: %s; a person must repair the effects, then resume the compensation with `retry %s`, "+
			"or, having undone the step by hand, go on with the next compensation with `skip %s --step %s`, or close the saga as handled with `close %s`", step.Name, key, how, reason, sg.ID, sg.ID, step.Name, sg.ID)
		finish(m, string(saga.StateFailed))
		return m, nil
	}
	if !def.CanTransition(sg.State, saga.StateCompensating) {
		return nil, fmt.Errorf("idemsaga: saga %s cannot start compensating from %q", sg.ID, sg.State)
	}
	plan, park := compensation.Plan(def, idx, effect)
	if park {
		m, _ := moveFrom(sg, saga.StateParked, step.Name, phase, attemptNo)
		m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, true
		m.Error = fmt.Sprintf("step %q may have taken effect at the other system (an attempt's outcome is unknown; its key is %s) and has no compensation, so nothing was undone: %s; "+
			"check the other system under that key, then retry the step with `retry %s` (the same key: the other system answers with what it did), "+
			"or, if it did take effect, go on with `skip %s --step %s --result JSON` (its result), "+
			"or, if it did not, compensate the steps before it with `cancel %s`, or close the saga as handled with `close %s`", step.Name, key, reason, sg.ID, sg.ID, step.Name, sg.ID, sg.ID)
		finish(m, string(saga.StateParked))
		return m, nil
	}
	to := saga.StateCompensating
	if len(plan) == 0 {
		to = saga.StateCompensated
	}
	m, after := moveFrom(sg, to, step.Name, phase, attemptNo)
	m.Status, m.StepError, m.PossiblyDone = saga.StepFailed, reason, possibly
	m.Error = fmt.Sprintf("step %q failed: %s", step.Name, reason)
	if possibly {
		m.Error = fmt.Sprintf("step %q (key %s) was given up and may have taken effect: %s; it is compensated first", step.Name, key, reason)
	}
	return c.compensate(m, after, def, plan)
}

// compensate makes m start plan: with nothing to undo the saga ends
// compensated; otherwise it is compensating and m dispatches the plan's
// first compensation.
func (c *core) compensate(m *store.Move, after *saga.Instance, def *saga.Definition, plan []int) (*store.Move, error) {
	if len(plan) == 0 {
		finish(m, string(saga.StateCompensated))
		return m, nil
	}
	after.State = saga.StateCompensating
	var err error
	m.Next, err = c.dispatch(after, def, plan[0], saga.PhaseCompensate)
	return m, err
}

// exhausted is the reason of a step whose attempts ran out.
func exhausted(attempts int, last string) string {
	return fmt.Sprintf("%d attempts exhausted; last error: %s", attempts, last)
}

// settled is what the inbox holds for a step the engine gives up.
type settled struct {
	outcome string
	unknown bool
	result  []byte
}

// settle fences a step's key in the inbox, in tx (which holds the saga's
// lock): a tombstone unless the key holds a final outcome, so no delivery
// can take effect after tx commits; and it reads what the key holds. A key
// held by an attempt still running returns store.ErrBusy, without
// waiting on it: that attempt may be waiting on the saga tx holds.
func (c *core) settle(ctx context.Context, tx *store.Tx, sagaID uuid.UUID, step string, phase saga.Phase) (settled, error) {
	return c.settleWith(ctx, tx, store.SettleTombstone, sagaID, step, phase)
}

// settleWith is settle with the tombstone statement given.
func (c *core) settleWith(ctx context.Context, tx *store.Tx, tombstone string, sagaID uuid.UUID, step string, phase saga.Phase) (settled, error) {
	key := saga.StepKey(sagaID, step, phase)
	var got bool
	var s settled
	tx.Queue(tombstone, func(row pgx.Row) error { return row.Scan(&got) },
		pguuid.Of(sagaID), pguuid.Of(key), step, string(phase), store.LockID(key))
	found := true
	tx.Queue(store.SettleRead, func(row pgx.Row) error {
		err := row.Scan(&s.outcome, &s.unknown, &s.result)
		if errors.Is(err, pgx.ErrNoRows) {
			found = false
			return nil
		}
		return err
	}, pguuid.Of(sagaID), pguuid.Of(key))
	if err := tx.Flush(ctx); err != nil {
		return s, fmt.Errorf("settle step %q (%s) of saga %s through the inbox: %w", step, phase, sagaID, err)
	}
	if !got {
		return s, fmt.Errorf("settle step %q (%s) of saga %s: %w", step, phase, sagaID, store.ErrBusy)
	}
	if !found {
		return s, fmt.Errorf("settle step %q (%s) of saga %s: the inbox holds nothing for its key after the tombstone", step, phase, sagaID)
	}
	return s, nil
}

// giveUp settles a step the engine gives up and queues the move that
// follows: a success found in the inbox is applied; otherwise the step
// failed, possibly done when the inbox or the step's row says so.
func (c *core) giveUp(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, possiblyDone bool, fx *effects) error {
	step := def.Step(idx)
	s, err := c.settle(ctx, tx, sg.ID, step.Name, phase)
	if err != nil {
		return err
	}
	var m *store.Move
	if s.outcome == "succeeded" {
		c.log.Info("step given up had taken effect; applied as a success", "saga_id", sg.ID, "step", step.Name, "phase", phase, "attempt", attemptNo)
		m, err = c.successMove(sg, def, idx, phase, attemptNo, s.result)
	} else {
		effect := compensation.NotDone
		if possiblyDone || s.unknown {
			effect = compensation.PossiblyDone
		}
		m, err = c.failureMove(sg, def, idx, phase, attemptNo, reason, effect)
	}
	if err != nil {
		return err
	}
	store.QueueMove(tx, m, c.handOffArg(), fx.moved(m))
	return nil
}

func outboxCommitted(id int64, subject, msgID string, payload []byte, headers map[string]string) outbox.Committed {
	return outbox.Committed{ID: id, Subject: subject, MsgID: msgID, Payload: payload, Headers: headers}
}
