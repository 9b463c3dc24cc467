package orchestrate

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/idemsaga/idemsaga/compensation"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/plan"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/jackc/pgx/v5"
)

// ErrStateForbids is returned by Retry and Cancel when the saga's state
// does not allow the repair asked for.
var ErrStateForbids = errors.New("idemsaga: the saga's state does not allow this")

// repairBusyWait bounds how long a repair waits for an attempt that holds
// the key of the step it settles.
const repairBusyWait = 10 * time.Second

// retryFn is Retry's work on a saga locked in tx.
func (c *Core) retryFn(ctx context.Context) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		id := sg.ID
		def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return err
		}
		var phase saga.Phase
		switch sg.State {
		case saga.StateFailed:
			phase = saga.PhaseCompensate
		case saga.StateParked:
			phase = saga.PhaseForward
		case saga.StateClosed:
			return fmt.Errorf("%w: saga %s was closed as handled by an operator (its repairs: `show %s`); nothing runs for it any more", ErrStateForbids, id, id)
		case saga.StateCompensated:
			return fmt.Errorf("%w: saga %s is compensated: a step failed and every completed step was undone, so no step runs again under its key "+
				"(its undo may already have reached other systems); to do the business again, start a new saga with a new key", ErrStateForbids, id)
		default:
			if sg.Finished() {
				return fmt.Errorf("%w: saga %s completed (state %q); there is nothing to retry", ErrStateForbids, id, sg.State)
			}
			return c.retryNow(ctx, tx, sg, def)
		}
		var step string
		var idx, attemptNo int
		err = c.schema.Q(tx.Conn()).QueryRow(ctx, `select step, step_index, attempt from idemsaga.steps
where saga_id = $1 and phase = $2 and status = 'failed' order by updated_at desc limit 1`, pguuid.Of(id), string(phase)).Scan(&step, &idx, &attemptNo)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: saga %s is %s without a failed %s step to resume; inspect it with `show %s`", ErrStateForbids, id, sg.State, phase, id)
		}
		if err != nil {
			return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
		}
		// A parked group's branches that failed run again together.
		failed := []stepAt{{step, idx, attemptNo}}
		if phase == saga.PhaseForward && def.HasGroups() {
			first, end := def.Group(idx)
			for _, st := range sg.Steps {
				b := def.StepIndex(st.Step)
				if b >= first && b < end && b != idx && st.Phase == saga.PhaseForward && st.Status == saga.StepFailed {
					failed = append(failed, stepAt{st.Step, b, st.Attempt})
				}
			}
		}
		resumed := *sg
		resumed.State, resumed.Version = saga.StateCompensating, sg.Version+1
		if phase == saga.PhaseForward {
			resumed.State = def.StateBefore(idx)
		}
		for _, f := range failed {
			if err := c.retryFailed(ctx, tx, &resumed, def, f, phase); err != nil {
				return err
			}
		}
		if err := store.ReopenSaga(ctx, tx.Schema().Q(tx.Conn()), id, sg.Version, resumed.State, false); err != nil {
			return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
		}
		return nil
	}
}

// retryNow dispatches now the next attempt of a running saga's step that
// waits out a retry's backoff; a step running its attempt is refused.
func (c *Core) retryNow(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition) error {
	var paused bool
	if err := c.schema.Q(tx.Conn()).QueryRow(ctx, `select not (`+store.NotPaused+`) from idemsaga.sagas s where s.id = $1`, pguuid.Of(sg.ID)).Scan(&paused); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", sg.ID, err)
	}
	if paused {
		return fmt.Errorf("%w: saga %s is paused (itself or with its definition; `show %s` says which); resume it, and its step in flight is sent again at the attempt it had",
			ErrStateForbids, sg.ID, sg.ID)
	}
	var step, phase, status string
	var idx, attemptNo int
	var lease *time.Time
	err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.SelectStepInFlight, pguuid.Of(sg.ID)).Scan(&step, &phase, &idx, &status, &attemptNo, &lease)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: saga %s is %s with no step in flight; `reconcile` reports why", ErrStateForbids, sg.ID, sg.State)
	}
	if err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: find its step in flight: %w", sg.ID, err)
	}
	if idx >= def.Len() || def.Step(idx).Name != step {
		return fmt.Errorf("idemsaga: retry saga %s: definition %q has no step %q at %d; deploy the same definition everywhere", sg.ID, sg.Definition, step, idx)
	}
	if saga.StepStatus(status) == saga.StepWaiting {
		until := "its deadline"
		if lease != nil {
			until = lease.UTC().Format(time.RFC3339)
		}
		return fmt.Errorf("%w: saga %s: step %q sent its request and waits for the other system's callback until %s; a retry would send the request again. "+
			"Complete it with the callback, skip it with the result the other system gave (`skip %s --step %s`), or cancel the saga",
			ErrStateForbids, sg.ID, step, until, sg.ID, step)
	}
	if saga.StepStatus(status) == saga.StepDispatched {
		until := "its lease"
		if lease != nil {
			until = lease.UTC().Format(time.RFC3339)
		}
		what := fmt.Sprintf("step %q (%s) is running attempt %d", step, phase, attemptNo)
		if sg.State == saga.StateCompensating && saga.Phase(phase) == saga.PhaseCompensate {
			what = fmt.Sprintf("it is compensating (a forward step failed and compensation began, so no forward step runs again: its undo may have reached other systems) and the compensation of step %q is running attempt %d", step, attemptNo)
		}
		return fmt.Errorf("%w: saga %s: %s; a retry would race it. Wait: its outcome, or the end of its lease (%s), brings the next attempt under the same key", ErrStateForbids, sg.ID, what, until)
	}
	return c.redispatch(tx, sg, def, idx, saga.Phase(phase), attemptNo)
}

// operatorCancel is the saga's error after an operator's cancel.
func operatorCancel(r Request) string {
	msg := "cancelled by an operator"
	if r.Reason != "" {
		msg += ": " + r.Reason
	}
	return msg
}

// cancel is Cancel, recorded as r, with msg the saga's error: for a
// saga's deadline (cancelLate).
func (c *Core) cancel(ctx context.Context, id uuid.UUID, r Request, msg string) (Result, error) {
	fx := &effects{}
	op := repairOp{name: "cancel", r: r, notDone: new(string)}
	return c.recorded(ctx, nil, id, op, c.cancelFn(ctx, msg, &fx, op.notDone), func() { c.emit(fx) })
}

// cancelFn is Cancel's work on a saga locked in tx, with msg the saga's
// error; *notDone receives the parked step a cancel of a parked saga takes
// as not done. *fx is replaced on every try, so that only the committed
// one's effects are emitted.
func (c *Core) cancelFn(ctx context.Context, msg string, fx **effects, notDone *string) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		*fx = &effects{}
		*notDone = ""
		id := sg.ID
		if sg.State == saga.StateParked {
			return c.cancelParked(ctx, tx, sg, msg, *fx, notDone)
		}
		if sg.Finished() || sg.State == saga.StateCompensating {
			return fmt.Errorf("%w: saga %s is %q; only a running saga that is not compensating, or a parked one, can be cancelled", ErrStateForbids, id, sg.State)
		}
		def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return err
		}
		var step string
		var idx, attemptNo int
		var possiblyDone bool
		var calling *time.Time
		err = c.schema.Q(tx.Conn()).QueryRow(ctx, `select st.step, st.step_index, st.attempt, st.possibly_done,
  case when st.status = 'dispatched' and st.lease_until > idemsaga.now() and i.outcome = 'started' then st.lease_until end
from idemsaga.steps st
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.saga_id = $1 and st.phase = 'forward' and st.status in ('dispatched', 'retrying', 'waiting')`, pguuid.Of(id)).Scan(&step, &idx, &attemptNo, &possiblyDone, &calling)
		if err != nil {
			return fmt.Errorf("idemsaga: cancel saga %s: find the step in flight: %w", id, err)
		}
		if calling != nil && def.Step(idx).Kind != saga.DatabaseStep {
			// Its undo would race the call: the other system could take
			// the call after the compensation. Its outcome comes within
			// its lease.
			return &StepInFlightError{SagaID: id, Step: step, Attempt: attemptNo, Until: *calling}
		}
		s, err := c.settleWith(ctx, tx, store.SettleTombstoneForCancel, id, step, saga.PhaseForward)
		if err != nil {
			return err
		}
		if s.outcome != "started" && def.HasGroups() {
			// The branches beside it finish their attempts first.
			if err := c.settleBranches(ctx, tx, sg, def, idx); errors.Is(err, store.ErrBusy) {
				return fmt.Errorf("%w: saga %s: a branch beside step %q is calling another system; cancel again once its attempt ended", ErrStepInFlight, id, step)
			} else if err != nil {
				return err
			}
		}
		if s.outcome == "started" {
			// Claimed after the look above: the call is in flight.
			var until time.Time
			if err := c.schema.Q(tx.Conn()).QueryRow(ctx, `select lease_until from idemsaga.steps where saga_id = $1 and step = $2 and phase = 'forward'`,
				pguuid.Of(id), step).Scan(&until); err != nil {
				return fmt.Errorf("idemsaga: cancel saga %s: read the lease of step %q: %w", id, step, err)
			}
			return &StepInFlightError{SagaID: id, Step: step, Attempt: attemptNo, Until: until}
		}
		var m *store.Move
		switch {
		case s.outcome == "succeeded" && def.HasGroups():
			m, err = c.plan.CancelSucceeded(sg, def, idx, attemptNo, msg, s.result)
		case s.outcome == "succeeded" && idx == def.Len()-1:
			// It completed the saga: apply that; there is nothing to cancel.
			m, err = c.plan.Success(sg, def, idx, saga.PhaseForward, attemptNo, s.result)
			if err == nil {
				err = fmt.Errorf("%w: saga %s completed before it could be cancelled", ErrStateForbids, id)
			}
			if m != nil {
				store.QueueMove(tx, m, c.handOffFor(tx), (*fx).moved(m))
			}
			return errCommitted{err}
		case s.outcome == "succeeded":
			// It completed: the steps up to it are compensated.
			m, err = c.cancelMove(sg, def, idx, attemptNo, msg, s.result)
		default:
			m, err = c.plan.Failure(sg, def, idx, saga.PhaseForward, attemptNo, msg, s.effect(possiblyDone))
			if err == nil && m.To != saga.StateParked {
				m.Error = msg
			}
		}
		if err != nil {
			return err
		}
		store.QueueMove(tx, m, c.handOffFor(tx), (*fx).moved(m))
		return nil
	}
}

// cancelMove is the move that cancels a saga whose step idx completed
// when it was settled: the step succeeds, and the saga compensates it and
// the steps before it.
func (c *Core) cancelMove(sg *saga.Instance, def *saga.Definition, idx, attemptNo int, msg string, result []byte) (*store.Move, error) {
	undo, _ := compensation.Plan(def, idx+1, compensation.NotDone, sg.Skipped)
	to := saga.StateCompensating
	if len(undo) == 0 {
		to = saga.StateCompensated
	}
	step := def.Step(idx)
	m, after := plan.MoveFrom(sg, to, step.Name, saga.PhaseForward, attemptNo)
	m.Status, m.StepResult, m.ResultStep, m.Result, m.Error = saga.StepSucceeded, result, step.Name, result, msg
	return c.plan.Compensate(m, after, def, undo)
}

// cancelParked compensates the steps before a parked saga's step, which it
// names in *notDone: taken as not done.
func (c *Core) cancelParked(ctx context.Context, tx *store.Tx, sg *saga.Instance, msg string, fx *effects, notDone *string) error {
	def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
	if err != nil {
		return err
	}
	var step string
	var idx int
	err = c.schema.Q(tx.Conn()).QueryRow(ctx, `select step, step_index from idemsaga.steps
where saga_id = $1 and phase = 'forward' and status = 'failed' order by updated_at desc limit 1`, pguuid.Of(sg.ID)).Scan(&step, &idx)
	if err != nil {
		return fmt.Errorf("idemsaga: cancel saga %s: find its parked step: %w", sg.ID, err)
	}
	*notDone = step
	undo, _ := compensation.Plan(def, idx, compensation.NotDone, sg.Skipped)
	if def.HasGroups() {
		undo = plan.Undo(def, sg, step)
	}
	return c.startCompensation(ctx, tx, sg, def, undo, msg, fx)
}

// startCompensation moves sg, locked in tx, to compensating with error
// msg, and dispatches undo: a line's plan (compensation.Plan), whose
// first compensation is dispatched, or a walk's frontier (a group's
// branches, dispatched together); with nothing to undo the saga ends
// compensated.
func (c *Core) startCompensation(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, undo []int, msg string, fx *effects) error {
	if !def.HasGroups() && len(undo) > 1 {
		// A line's plan: its first compensation dispatches the next.
		undo = undo[:1]
	}
	to := saga.StateCompensating
	if len(undo) == 0 {
		to = saga.StateCompensated
	}
	after := *sg
	after.State, after.Version = saga.StateCompensating, sg.Version+1
	var outboxID *int64
	var subject, msgID string
	var payload []byte
	var err error
	if len(undo) > 0 {
		if subject, msgID, payload, err = c.plan.Command(&after, def, undo[0], saga.PhaseCompensate, 1, false); err != nil {
			return err
		}
		first := def.Step(undo[0]).Name
		if err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.DispatchCompensation,
			pguuid.Of(sg.ID), first, undo[0], pguuid.Of(saga.StepKey(sg.ID, first, saga.PhaseCompensate)),
			c.plan.LeaseMillis(plan.PolicyOf(def, undo[0], saga.PhaseCompensate)), subject, msgID, payload, c.handOffFor(tx), store.HeadersJSON(tx.Trace())).Scan(&outboxID); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("idemsaga: compensate saga %s: dispatch the compensation: %w", sg.ID, err)
		}
	}
	if outboxID != nil {
		tx.Sent(outboxCommitted(*outboxID, subject, msgID, payload, tx.Trace()))
	}
	if len(undo) > 1 {
		// A group's branches are undone at once.
		var also []*store.Dispatch
		for _, b := range undo[1:] {
			d, err := c.plan.Dispatch(&after, def, b, saga.PhaseCompensate)
			if err != nil {
				return err
			}
			also = append(also, d)
		}
		store.QueueBranches(tx, sg.ID, also, c.handOffFor(tx))
		if err := tx.Flush(ctx); err != nil {
			return fmt.Errorf("idemsaga: compensate saga %s: dispatch the compensations: %w", sg.ID, err)
		}
	}
	created, err := store.CancelSaga(ctx, tx.Schema().Q(tx.Conn()), sg.ID, sg.Version, to, msg, len(undo) == 0)
	if err != nil {
		return fmt.Errorf("idemsaga: compensate saga %s: %w", sg.ID, err)
	}
	if len(undo) == 0 {
		m := &store.Move{Saga: sg.ID, Definition: sg.Definition, To: to, Finished: true, Outcome: string(saga.StateCompensated)}
		*fx.moved(m) = created
	}
	return nil
}

// ErrStepInFlight is returned by Cancel while an external step's attempt
// is calling the other system: compensating it then would race the call.
// Cancel again once the attempt ended (StepInFlightError.Until at the
// latest, when its lease runs out). Nothing was written.
var ErrStepInFlight = errors.New("idemsaga: a step of the saga is calling another system")

// StepInFlightError is ErrStepInFlight with the attempt and its lease.
type StepInFlightError struct {
	SagaID  uuid.UUID
	Step    string
	Attempt int
	// Until is when the attempt's lease runs out, on the database clock.
	Until time.Time
}

func (e *StepInFlightError) Error() string {
	return fmt.Sprintf("%v: step %q of saga %s is in attempt %d, calling the other system, until %s at the latest; cancel again once it answered (its undo now could reach the other system before the call)",
		ErrStepInFlight, e.Step, e.SagaID, e.Attempt, e.Until.Format(time.RFC3339))
}

func (e *StepInFlightError) Unwrap() error { return ErrStepInFlight }

// ErrRepairKeyReused is returned when a repair's key already names
// another request for the saga (another operation or reason). Nothing is
// written.
var ErrRepairKeyReused = errors.New("idemsaga: this repair key was already used for another request on this saga; use a new key")

// repairOp is one repair as recorded: its name, the request, and what
// else the request carries that its key must match.
type repairOp struct {
	// name is the operation: one of Repairs.
	name string
	r    Request
	// extra is what the request carries beside its reason (a skip's
	// step and result), hashed with it: the same key with another is
	// ErrRepairKeyReused.
	extra string
	// step, if set, names the step the repair is about (a skip's), for
	// the record; the repair's work sets *phase to its phase.
	step  string
	phase *saga.Phase
	// notDone, if set, receives from the repair's work the forward step
	// it takes as not done (a cancel of a parked saga), for the record.
	notDone *string
	// dryRun runs the repair in a transaction that is rolled back: the
	// result says what it would do, and nothing is written or sent.
	dryRun bool
}

// errDryRun makes a dry run's transaction roll back.
var errDryRun = errors.New("idemsaga: dry run")

// recorded runs a repair under the saga's lock and records it in
// idemsaga.repairs in the same transaction, so that a request sent again
// after a lost answer (a crash, a timeout) finds the first one's record
// and changes nothing.
func (c *Core) recorded(ctx context.Context, in pgx.Tx, id uuid.UUID, op repairOp, fn func(tx *store.Tx, sg *saga.Instance) error, after func()) (Result, error) {
	r := op.r
	if r.Key == "" {
		r.Key = uuid.NewString()
	}
	if err := saga.CheckKey(r.Key); err != nil {
		return Result{}, err
	}
	sum := sha256.Sum256([]byte(op.name + "\x00" + r.Reason + op.extra))
	var res Result
	if op.dryRun {
		after = nil
	}
	err := c.withSagaLocked(ctx, in, id, op.name, func(tx *store.Tx, sg *saga.Instance) error {
		res = Result{ID: id, Operation: op.name, Key: r.Key, Before: sg.State, DryRun: op.dryRun}
		var hash []byte
		var state string
		err := c.schema.Q(tx.Conn()).QueryRow(ctx, `select request_hash, state_after, created_at from idemsaga.repairs where saga_id = $1 and request_key = $2`,
			pguuid.Of(id), r.Key).Scan(&hash, &state, &res.At)
		switch {
		case err == nil && bytes.Equal(hash, sum[:]):
			res.State, res.Replayed = saga.State(state), true
			if op.dryRun {
				return errDryRun
			}
			return nil
		case err == nil:
			return fmt.Errorf("%w (saga %s, key %q)", ErrRepairKeyReused, id, r.Key)
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("idemsaga: %s saga %s: read its repairs: %w", op.name, id, err)
		}
		if err := fn(tx, sg); err != nil {
			var committed errCommitted
			if op.dryRun && errors.As(err, &committed) {
				// Nothing commits in a dry run.
				return committed.err
			}
			return err
		}
		if op.dryRun {
			tx.Queue(`select state::text, idemsaga.now() from idemsaga.sagas where id = $1`, func(row pgx.Row) error {
				var st string
				if err := row.Scan(&st, &res.At); err != nil {
					return fmt.Errorf("idemsaga: %s saga %s: read what the repair would leave: %w", op.name, id, err)
				}
				res.State = saga.State(st)
				return nil
			}, pguuid.Of(id))
			if err := tx.Flush(ctx); err != nil {
				return err
			}
			return errDryRun
		}
		var step, phase *string
		if op.step != "" && op.phase != nil {
			p := string(*op.phase)
			step, phase = &op.step, &p
		} else if op.notDone != nil && *op.notDone != "" {
			p := string(saga.PhaseForward)
			step, phase = op.notDone, &p
		}
		// Queued after the repair's own writes: it reads the state they
		// leave.
		tx.Queue(store.InsertRepair, func(row pgx.Row) error {
			var st string
			if err := row.Scan(&st, &res.At); err != nil {
				return fmt.Errorf("idemsaga: %s saga %s: record the repair: %w", op.name, id, err)
			}
			res.State = saga.State(st)
			return nil
		}, pguuid.Of(id), r.Key, op.name, sum[:], r.Reason, r.By, step, phase)
		return nil
	}, after)
	if errors.Is(err, errDryRun) {
		err = nil
	}
	return res, err
}

// errCommitted wraps the error of a repair whose writes are to commit
// anyway.
type errCommitted struct{ err error }

func (e errCommitted) Error() string { return e.err.Error() }

func (e errCommitted) Unwrap() error { return e.err }

// withSagaLocked runs fn in a transaction that holds saga id's lock, and
// commits what it queued unless it returns an error (but an errCommitted,
// which is returned after the commit). A key held by an attempt still
// running (store.ErrBusy) is waited out, each time in a new
// transaction, up to repairBusyWait. after, if not nil, runs after a
// commit. With in, a caller's transaction, each try is a savepoint in it
// (store.Within), and after does not run: the commit is the caller's.
func (c *Core) withSagaLocked(ctx context.Context, in pgx.Tx, id uuid.UUID, what string, fn func(tx *store.Tx, sg *saga.Instance) error, after func()) error {
	deadline := time.Now().Add(repairBusyWait)
	// Give up waiting before the caller's own deadline, so that it hears
	// why (a busy key, a call in flight) rather than a timeout.
	if d, ok := ctx.Deadline(); ok && d.Add(-time.Second).Before(deadline) {
		deadline = d.Add(-time.Second)
	}
	for delay := 20 * time.Millisecond; ; delay = min(2*delay, 500*time.Millisecond) {
		err := c.lockedOnce(ctx, in, id, what, fn, after)
		// A key held by a running attempt, or an external call in flight,
		// usually ends in milliseconds.
		if !errors.Is(err, store.ErrBusy) && !errors.Is(err, ErrStepInFlight) || time.Now().Add(delay).After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
	}
}

func (c *Core) lockedOnce(ctx context.Context, in pgx.Tx, id uuid.UUID, what string, fn func(tx *store.Tx, sg *saga.Instance) error, after func()) (err error) {
	var tx *store.Tx
	if in != nil {
		tx = store.Within(in, c.schema)
	} else {
		conn, err := c.pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("idemsaga: %s saga %s: %w", what, id, err)
		}
		defer conn.Release()
		tx = store.Begin(conn.Conn(), c.schema)
	}
	defer tx.Rollback(ctx)
	var sg *saga.Instance
	tx.Queue(store.SelectSagaByIDLocked, func(row pgx.Row) error {
		var err error
		sg, err = store.ScanSaga(row)
		return err
	}, pguuid.Of(id))
	var traced map[string]string
	if c.tracer.Enabled() {
		tx.Queue(store.SelectTraceContext, func(row pgx.Row) error { return ignoreNoRows(row.Scan(&traced)) }, pguuid.Of(id))
	}
	if err := tx.Flush(ctx); err != nil {
		if errors.Is(err, saga.ErrNotFound) {
			return fmt.Errorf("%w: %s", saga.ErrNotFound, id)
		}
		return fmt.Errorf("idemsaga: %s saga %s: %w", what, id, err)
	}
	if c.tracer.Enabled() {
		// A repair or a callback continues the saga's trace from its
		// start: the commands it writes carry the span's context.
		var sp tracing.Span
		ctx, sp = c.tracer.StartRepair(ctx, traced, sg.ID, sg.Definition, what)
		tx.SetTrace(c.tracer.Headers(ctx))
		defer func() { sp.End("", err) }()
	}
	if def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion); err == nil {
		if err := c.withSteps(ctx, tx, sg, def); err != nil {
			return fmt.Errorf("idemsaga: %s saga %s: %w", what, id, err)
		}
	}
	ferr := fn(tx, sg)
	var committed errCommitted
	if ferr != nil && !errors.As(ferr, &committed) {
		return ferr
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: %s saga %s: %w", what, id, err)
	}
	// In a caller's transaction nothing is committed yet: its rows are
	// the relay's once it commits, and nothing is counted.
	if !tx.Nested() {
		c.sent(tx.Published())
		if after != nil {
			after()
		}
	}
	if ferr != nil {
		return committed.err
	}
	return nil
}

// stepAt is a step of a saga, where it is in its definition and at
// which attempt.
type stepAt struct {
	step         string
	idx, attempt int
}

// retryFailed makes failed step f of saga resumed (as the retry leaves it)
// run again in phase, at its next attempt under the same key.
func (c *Core) retryFailed(ctx context.Context, tx *store.Tx, resumed *saga.Instance, def *saga.Definition, f stepAt, phase saga.Phase) error {
	id := resumed.ID
	key := saga.StepKey(id, f.step, phase)
	// A database step's key holds its failure, cleared; an external
	// step's keeps what it knows (an unknown outcome stays unknown) as
	// a key the next attempt may claim.
	if _, err := c.schema.Q(tx.Conn()).Exec(ctx, store.ClearFailedKey,
		pguuid.Of(id), pguuid.Of(key)); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: clear the inbox: %w", id, err)
	}
	if phase == saga.PhaseForward && def.Step(f.idx).Kind == saga.CallbackStep {
		// A callback that came after the step was given up is the
		// other system's word on the request sent again: it applies
		// once the step waits.
		if _, err := c.schema.Q(tx.Conn()).Exec(ctx, store.ReopenLateCallbacks, pguuid.Of(id), f.step); err != nil {
			return fmt.Errorf("idemsaga: retry saga %s: reopen its late callbacks: %w", id, err)
		}
	}
	var next int
	if err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.RetryFailedStep, pguuid.Of(id), f.step, string(phase), f.attempt,
		c.plan.LeaseMillis(plan.PolicyOf(def, f.idx, phase))).Scan(&next); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: %w", id, err)
	}
	subject, msgID, payload, err := c.plan.Command(resumed, def, f.idx, phase, next, false)
	if err != nil {
		return err
	}
	var outboxID int64
	if err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.InsertOutbox,
		subject, msgID, payload, pguuid.Of(id), c.handOffFor(tx), store.HeadersJSON(tx.Trace())).Scan(&outboxID); err != nil {
		return fmt.Errorf("idemsaga: retry saga %s: write the command: %w", id, err)
	}
	tx.Sent(outboxCommitted(outboxID, subject, msgID, payload, tx.Trace()))
	return nil
}
