package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// children runs the phases of child steps (saga.ChildStep) for the step
// workers (attempt.Children): it starts children through the client, as
// any saga starts, and cancels or compensates them as repairs recorded
// on the child, by the engine, for its parent.
type children struct{ cl *Client }

// childRepairBy names the engine in a child's repairs.
const childRepairBy = "idemsaga (parent saga)"

func (ch children) Start(ctx context.Context, sc *saga.StepContext, name string, version int, input json.RawMessage) (uuid.UUID, error) {
	def, err := ch.cl.c.DefinitionAt(ctx, name, version)
	if err != nil {
		return uuid.Nil, saga.Permanent(fmt.Errorf("child %s of step %q: %w", saga.Ref(name, version), sc.Step, err))
	}
	key := saga.ChildKey(sc.Key)
	var res StartResult
	var sent []outbox.Committed
	err = pgx.BeginFunc(ctx, ch.cl.c.Pool(), func(tx pgx.Tx) error {
		var led bool
		err := ch.cl.c.Schema().Q(tx).QueryRow(ctx, store.FenceChildStart, pguuid.Of(sc.SagaID), pguuid.Of(sc.Key), sc.Attempt).Scan(&led)
		if errors.Is(err, pgx.ErrNoRows) {
			return saga.NotApplied(fmt.Errorf("attempt %d of step %q no longer holds its key (given up, or taken over); its child is not started", sc.Attempt, sc.Step))
		}
		if err != nil {
			return fmt.Errorf("hold the key of step %q: %w", sc.Step, err)
		}
		if res, sent, err = ch.cl.start(ctx, tx, def, key, input, ch.cl.c.HandOffArg()); err != nil {
			return err
		}
		if res.Duplicate {
			return nil
		}
		_, err = ch.cl.c.Schema().Q(tx).Exec(ctx, store.SetParent, pguuid.Of(res.ID), pguuid.Of(sc.SagaID), sc.Step)
		return err
	})
	var inputErr *saga.InputError
	switch {
	case errors.As(err, &inputErr), errors.Is(err, saga.ErrIdempotencyKeyReused):
		// The child refuses what the step gives it: no attempt changes that.
		return uuid.Nil, saga.Permanent(fmt.Errorf("child %s refused its input: %w", def.Ref(), err))
	case err != nil:
		return uuid.Nil, fmt.Errorf("start child %s: %w", def.Ref(), err)
	}
	ch.cl.c.Sent(sent)
	return res.ID, nil
}

func (ch children) Find(ctx context.Context, sc *saga.StepContext, name string) (uuid.UUID, bool, error) {
	var id uuid.UUID
	err := ch.cl.c.DB().QueryRow(ctx, `select id from idemsaga.sagas where definition = $1 and idem_key = $2`,
		name, saga.ChildKey(saga.StepKey(sc.SagaID, sc.Step, saga.PhaseForward))).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return uuid.Nil, false, nil
	}
	if err != nil {
		return uuid.Nil, false, fmt.Errorf("find the child of step %q: %w", sc.Step, err)
	}
	return id, true, nil
}

// Undo orders the child compensated, as its state allows: a running or
// parked child is cancelled, a completed one compensated whole, a failed
// one's compensation resumed (retried); one compensating, compensated or
// closed is left as it is. The step's wait reads the child's end. A child calling another system is waited out (a retry
// of the compensation when its call's lease ends).
func (ch children) Undo(ctx context.Context, sc *saga.StepContext, name string) (uuid.UUID, bool, error) {
	id, found, err := ch.Find(ctx, sc, name)
	if err != nil || !found {
		return id, found, err
	}
	reason := fmt.Sprintf("its parent saga %s compensates step %q", sc.SagaID, sc.Step)
	for range 3 {
		sg, err := store.LoadSaga(ctx, ch.cl.c.DB(), id, false)
		if err != nil {
			return id, true, fmt.Errorf("read child saga %s: %w", id, err)
		}
		def, err := ch.cl.c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if err != nil {
			return id, true, err
		}
		var op string
		switch {
		case sg.State == saga.StateCompensating, sg.State == saga.StateCompensated, sg.State == saga.StateClosed:
			return id, true, nil
		case sg.State == saga.StateFailed:
			// Its compensation could not finish: each attempt of the
			// parent's (an operator's retry of the parent, say) resumes it
			// once; should it fail again, so does the parent's.
			op = "retry"
			_, err = ch.cl.c.Repair(ctx, nil, id, "retry", orchestrate.Skip{}, orchestrate.Request{Key: fmt.Sprintf("parent:%s:retry:%d", sc.Key, sc.Attempt), Reason: reason, By: childRepairBy}, false)
		case sg.State == def.FinalState():
			op = "compensate"
			_, err = ch.cl.c.CompensateCompleted(ctx, id, orchestrate.Request{Key: "parent:" + sc.Key.String() + ":compensate", Reason: reason, By: childRepairBy})
		default:
			op = "cancel"
			_, err = ch.cl.c.Repair(ctx, nil, id, "cancel", orchestrate.Skip{}, orchestrate.Request{Key: "parent:" + sc.Key.String() + ":cancel", Reason: reason, By: childRepairBy}, false)
		}
		var busy *orchestrate.StepInFlightError
		switch {
		case err == nil:
			return id, true, nil
		case errors.As(err, &busy):
			return id, true, saga.RetryAfter(fmt.Errorf("child saga %s: %w", id, err), max(time.Until(busy.Until), time.Second))
		case errors.Is(err, orchestrate.ErrStateForbids):
			continue // it moved meanwhile: look again
		default:
			return id, true, fmt.Errorf("%s child saga %s: %w", op, id, err)
		}
	}
	return id, true, fmt.Errorf("child saga %s kept moving while its parent ordered it to compensate; the next attempt orders it again", id)
}

// withChildren adds to c.Definitions the children their child steps
// run, at every depth, that are not there: an engine runs a parent's
// children with it. A child given under the same name and version but
// built otherwise is refused.
func (c *Config) withChildren() error {
	have := map[string]*saga.Definition{}
	for _, d := range c.Definitions {
		if d != nil {
			have[d.Ref()] = d
		}
	}
	defs := slices.Clone(c.Definitions)
	for i := 0; i < len(defs); i++ {
		if defs[i] == nil {
			continue
		}
		for _, child := range defs[i].Children() {
			had, ok := have[child.Ref()]
			switch {
			case !ok:
				have[child.Ref()] = child
				defs = append(defs, child)
			case had != child && had.Describe().Fingerprint() != child.Describe().Fingerprint():
				return fmt.Errorf("idemsaga: Config.Definitions: %s runs child %s, and Definitions gives another %s (%s); give the one its parent runs, or a new version of it",
					defs[i].Ref(), child.Ref(), child.Ref(), describeDifference(had.Describe(), child.Describe()))
			}
		}
	}
	c.Definitions = defs
	return nil
}

// loadChildren fills sg.Children, for inspection.
func (cl *Client) loadChildren(ctx context.Context, q querier, sg *saga.Instance) error {
	rows, err := q.Query(ctx, cl.c.Schema().SQL(store.SelectChildren), pguuid.Of(sg.ID))
	if err != nil {
		return fmt.Errorf("idemsaga: read the children of saga %s: %w", sg.ID, err)
	}
	sg.Children, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (saga.ChildRecord, error) {
		var ch saga.ChildRecord
		var state string
		err := row.Scan(&ch.Step, &ch.ID, &ch.Definition, &state)
		ch.State = saga.State(state)
		return ch, err
	})
	if err != nil {
		return fmt.Errorf("idemsaga: read the children of saga %s: %w", sg.ID, err)
	}
	return nil
}
