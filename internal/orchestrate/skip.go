package orchestrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	jsonv2 "github.com/go-json-experiment/json"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/jackc/pgx/v5"
)

// ErrInvalidResult is returned by Skip for a result that is not one
// strict JSON value. Nothing is written.
var ErrInvalidResult = errors.New("idemsaga: invalid step result")

// ErrResultTooLarge is returned for a step result, a skip's or a
// callback's, over the deployment's bound (engine.Config.MaxResultBytes).
// Nothing is written.
var ErrResultTooLarge = saga.ErrResultTooLarge

// TooLarge is the error for a result of n bytes over max bytes, for what
// (a step, a skip, a callback).
func TooLarge(what string, n, max int) error {
	return fmt.Errorf("%w: %s is %d bytes, over the %d-byte bound (Config.MaxResultBytes, which commands and the saga's row carry); keep large data in your own table and return its id", ErrResultTooLarge, what, n, max)
}

// skipOp checks a skip's request and returns it as recorded.
func skipOp(s Skip, r Request, max int) (repairOp, error) {
	if s.Step == "" {
		return repairOp{}, fmt.Errorf("%w: name the step to skip (`show` lists the saga's steps)", ErrStateForbids)
	}
	res, err := checkResult(s.Result, max)
	if err != nil {
		return repairOp{}, err
	}
	return repairOp{name: "skip", r: r, extra: "\x00" + s.Step + "\x00" + string(res), step: s.Step, phase: new(saga.Phase)}, nil
}

// checkResult decodes a step result strictly and returns it canonical.
func checkResult(raw json.RawMessage, max int) (json.RawMessage, error) {
	if len(raw) == 0 {
		return json.RawMessage("null"), nil
	}
	var v any
	if err := jsonv2.Unmarshal(raw, &v); err != nil {
		return nil, fmt.Errorf("%w: %v; give one JSON value, each member name once (null for none)", ErrInvalidResult, err)
	}
	out, err := saga.CanonicalInput(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidResult, err)
	}
	if max > 0 && len(out) > max {
		return nil, TooLarge("the skip's result", len(out), max)
	}
	return out, nil
}

// skipFn is Skip's work on a saga locked in tx. *fx is replaced on every
// try, so that only the committed one's effects are emitted.
func (c *Core) skipFn(ctx context.Context, s Skip, r Request, skipped *saga.Phase, fx **effects) func(tx *store.Tx, sg *saga.Instance) error {
	result, _ := checkResult(s.Result, c.maxResult)
	note := "skipped by an operator"
	if r.By != "" {
		note += " (" + r.By + ")"
	}
	if r.Reason != "" {
		note += ": " + r.Reason
	}
	return func(tx *store.Tx, sg *saga.Instance) error {
		*fx = &effects{}
		id := sg.ID
		def, err := c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return err
		}
		var step, phase, status string
		var idx, attemptNo int
		var lease *time.Time
		switch {
		case sg.State == saga.StateParked || sg.State == saga.StateFailed:
			want := saga.PhaseForward
			if sg.State == saga.StateFailed {
				want = saga.PhaseCompensate
			}
			err = c.schema.Q(tx.Conn()).QueryRow(ctx, `select step, phase::text, step_index, status::text, attempt, lease_until from idemsaga.steps
where saga_id = $1 and phase = $2 and status = 'failed' order by step = $3 desc, updated_at desc limit 1`, pguuid.Of(id), string(want), s.Step).Scan(&step, &phase, &idx, &status, &attemptNo, &lease)
		case sg.Finished():
			return fmt.Errorf("%w: saga %s is %q, finished; only a running, parked or failed saga's step can be skipped", ErrStateForbids, id, sg.State)
		default:
			err = c.schema.Q(tx.Conn()).QueryRow(ctx, store.SelectNamedStepInFlight, pguuid.Of(id), s.Step).Scan(&step, &phase, &idx, &status, &attemptNo, &lease)
		}
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: saga %s is %s with no step to skip; inspect it with `show %s`", ErrStateForbids, id, sg.State, id)
		}
		if err != nil {
			return fmt.Errorf("idemsaga: skip a step of saga %s: %w", id, err)
		}
		if step != s.Step {
			return fmt.Errorf("%w: saga %s is at step %q (%s), not %q; nothing was skipped: check it with `show %s`", ErrStateForbids, id, step, phase, s.Step, id)
		}
		if idx >= def.Len() || def.Step(idx).Name != step {
			return fmt.Errorf("idemsaga: skip step %q of saga %s: definition %q has no such step at %d; deploy the same definition everywhere", step, id, sg.Definition, idx)
		}
		if def.HasGroups() && saga.Phase(phase) == saga.PhaseForward {
			// A group completes when every branch succeeded: a skip of one
			// branch beside another that failed would leave it waiting.
			first, end := def.Group(idx)
			for _, st := range sg.Steps {
				if b := def.StepIndex(st.Step); b >= first && b < end && st.Step != step && st.Phase == saga.PhaseForward && st.Status == saga.StepFailed {
					return fmt.Errorf("%w: branch %q of the group of step %q failed too; nothing was skipped: run every failed branch again with `retry %s`, or cancel the saga",
						ErrStateForbids, st.Step, step, id)
				}
			}
		}
		ph := saga.Phase(phase)
		*skipped = ph
		resumed := *sg
		if saga.StepStatus(status) != saga.StepFailed {
			// A step in flight: fence its key first.
			if saga.StepStatus(status) == saga.StepDispatched && def.Step(idx).Kind == saga.ExternalStep {
				var calling bool
				if err := tx.Schema().Q(tx.Conn()).QueryRow(ctx, `select exists (select 1 from idemsaga.inbox where saga_id = $1 and step_key = $2 and outcome = 'started')
  and $3::timestamptz > idemsaga.now()`, pguuid.Of(id), pguuid.Of(saga.StepKey(id, step, ph)), lease).Scan(&calling); err != nil {
					return fmt.Errorf("idemsaga: skip step %q of saga %s: %w", step, id, err)
				}
				if calling {
					return &StepInFlightError{SagaID: id, Step: step, Attempt: attemptNo, Until: *lease}
				}
			}
			st, err := c.settleWith(ctx, tx, store.SettleTombstoneForCancel, id, step, ph)
			if err != nil {
				return err
			}
			switch st.outcome {
			case "started":
				// Claimed after the look above: the call is in flight.
				until := time.Now()
				if lease != nil {
					until = *lease
				}
				return &StepInFlightError{SagaID: id, Step: step, Attempt: attemptNo, Until: until}
			case "succeeded":
				// It took effect on its own: apply that, not the skip.
				m, err := c.plan.Success(sg, def, idx, ph, attemptNo, st.result)
				if err != nil {
					return err
				}
				store.QueueMove(tx, m, c.handOffFor(tx), (*fx).moved(m))
				return errCommitted{fmt.Errorf("%w: step %q of saga %s took effect before it could be skipped; its own result was applied and nothing was skipped", ErrStateForbids, step, id)}
			}
		} else {
			// Parked or failed: the saga is open again, at the step.
			resumed.State = def.StateBefore(idx)
			if ph == saga.PhaseCompensate {
				resumed.State = saga.StateCompensating
			}
			resumed.Version, resumed.FinishedAt, resumed.Error = sg.Version+1, nil, ""
			if err := store.ReopenSaga(ctx, tx.Schema().Q(tx.Conn()), id, sg.Version, resumed.State, true); err != nil {
				return fmt.Errorf("idemsaga: skip step %q of saga %s: %w", step, id, err)
			}
		}
		// The skip is an attempt of its own, after the one it ends.
		var next int
		if err := c.schema.Q(tx.Conn()).QueryRow(ctx, store.SkipAttempt, pguuid.Of(id), step, phase, attemptNo, note).Scan(&next); err != nil {
			return fmt.Errorf("idemsaga: skip step %q of saga %s: %w", step, id, err)
		}
		sealed, err := c.sealer.Seal(id, result)
		if err != nil {
			return err
		}
		m, err := c.plan.Success(&resumed, def, idx, ph, next, sealed)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrStateForbids, err)
		}
		m.StepError = note
		store.QueueMove(tx, m, c.handOffFor(tx), (*fx).moved(m))
		return nil
	}
}

// closeFn is Close's work on a saga locked in tx; it fills *closed with
// the move it made, for the metrics and Config.OnFinishedFunc.
func closeFn(ctx context.Context, closed *store.Move) func(tx *store.Tx, sg *saga.Instance) error {
	return func(tx *store.Tx, sg *saga.Instance) error {
		*closed = store.Move{Saga: sg.ID, Definition: sg.Definition, From: sg.State, Version: sg.Version, To: saga.StateClosed,
			Finished: true, Outcome: string(saga.StateClosed)}
		switch {
		case sg.State == saga.StateFailed || sg.State == saga.StateParked:
		case sg.State == saga.StateClosed:
			return fmt.Errorf("%w: saga %s is already closed (its repairs: `show %s`)", ErrStateForbids, sg.ID, sg.ID)
		case !sg.Finished():
			return fmt.Errorf("%w: saga %s is %q, running; only a failed or parked saga can be closed (cancel a running one with `cancel %s`)", ErrStateForbids, sg.ID, sg.State, sg.ID)
		default:
			return fmt.Errorf("%w: saga %s is %q, finished without needing a person; only a failed or parked saga can be closed", ErrStateForbids, sg.ID, sg.State)
		}
		var inFlight bool
		if err := tx.Schema().Q(tx.Conn()).QueryRow(ctx, `select exists (select 1 from idemsaga.steps where saga_id = $1 and status in ('dispatched', 'retrying', 'waiting'))`,
			pguuid.Of(sg.ID)).Scan(&inFlight); err != nil {
			return fmt.Errorf("idemsaga: close saga %s: %w", sg.ID, err)
		}
		if inFlight {
			// A finished saga has none (reconcile checks it): not closed
			// over a step that could still run.
			return fmt.Errorf("idemsaga: close saga %s: it is %s with a step in flight: %w", sg.ID, sg.State, store.ErrInvariant)
		}
		if err := store.CloseSaga(ctx, tx.Schema().Q(tx.Conn()), sg.ID, sg.Version); err != nil {
			return fmt.Errorf("idemsaga: close saga %s: %w", sg.ID, err)
		}
		return nil
	}
}

// CheckSkip refuses a skip without a step or with a result that is not one
// JSON value or is over the bound, before anything is read or written.
func (c *Core) CheckSkip(s Skip) error {
	_, err := skipOp(s, Request{}, c.maxResult)
	return err
}

// MaxResult is the bound of a step result, in bytes.
func (c *Core) MaxResult() int { return c.maxResult }
