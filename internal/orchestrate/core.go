package orchestrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/idemsaga/idemsaga/internal/plan"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/compensation"
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

// Core moves sagas on everything that is not a step's own attempt: the
// replies the orchestrator consumes, the reaper's leases and deadlines,
// callbacks, repairs and dead letters resent. The engine's Client and
// Engine are its callers; every write goes through package store.
type Core struct {
	pool   *pgxpool.Pool
	schema *pgschema.Schema
	sealer *seal.Sealer
	// defs are this process's definitions, the newest version of each
	// name; versions all of them, by name and version; remote those known
	// only by the deployment's record (Client.Definition); refs names
	// versions as "name@version".
	defs     map[string]*saga.Definition
	versions map[defKey]*saga.Definition
	// all are versions' values by Ref, names defs' keys sorted.
	all      []*saga.Definition
	names    []string
	refs     []string
	remote   described
	subjects wire.Subjects
	// plan decides the moves.
	plan      plan.Planner
	maxInput  int
	maxResult int
	metrics   *metrics.Metrics
	log       *slog.Logger
	// tracer is Config.TracerProvider's; nil traces nothing.
	tracer *tracing.Tracer
	// out takes the outbox rows the core's transactions commit; nil for a
	// client that runs no worker (the rows are the relay's at once).
	out HandOff
	// onFinished is Config.OnFinishedFunc.
	onFinished func(id uuid.UUID, definition string, state saga.State)
	// children names the definitions some ChildStep runs; childEnds
	// takes the IDs of their sagas that finished (ChildEnds).
	children  map[string]bool
	childEnds chan uuid.UUID
}

// Config is what a Core is built from (the engine's Config, resolved).
type Config struct {
	Pool *pgxpool.Pool
	// Schema is the deployment's schema; nil for pgschema.SchemaDefault.
	Schema *pgschema.Schema
	// Sealer seals and opens the sagas' data (engine.Config.Codec).
	Sealer      *seal.Sealer
	Definitions []*saga.Definition
	// SubjectPrefix and LeaseGrace are the deployment's.
	SubjectPrefix string
	LeaseGrace    time.Duration
	MaxInputBytes int
	// MaxResultBytes bounds a step's result (engine.Config.MaxResultBytes).
	MaxResultBytes int
	Metrics        *metrics.Metrics
	Logger         *slog.Logger
	// Tracer, if enabled, traces repairs, callbacks and the reaper.
	Tracer *tracing.Tracer
	// HandOff takes the rows the core's transactions commit; nil for a
	// client that runs no worker.
	HandOff HandOff
	// OnFinished, if set, is called for each saga that finished
	// (engine.Config.OnFinishedFunc).
	OnFinished func(id uuid.UUID, definition string, state saga.State)
}

// New returns a core.
func New(cfg Config) *Core {
	defs, versions := indexDefinitions(cfg.Definitions)
	subjects := wire.Subjects{Prefix: cfg.SubjectPrefix}
	all := slices.Collect(maps.Values(versions))
	slices.SortFunc(all, func(a, b *saga.Definition) int { return strings.Compare(a.Ref(), b.Ref()) })
	children := map[string]bool{}
	for _, d := range all {
		for i := range d.Len() {
			if name, _, ok := d.Child(i); ok {
				children[name] = true
			}
		}
	}
	return &Core{all: all, children: children, childEnds: make(chan uuid.UUID, childEndsQueue), names: slices.Sorted(maps.Keys(defs)),
		pool: cfg.Pool, schema: cfg.Schema, sealer: cfg.Sealer, defs: defs, versions: versions, refs: refsOf(versions), subjects: subjects,
		plan: plan.Planner{Subjects: subjects, LeaseGrace: cfg.LeaseGrace, Sealer: cfg.Sealer}, maxInput: cfg.MaxInputBytes, maxResult: cfg.MaxResultBytes,
		metrics: cfg.Metrics, log: cfg.Logger, onFinished: cfg.OnFinished, tracer: cfg.Tracer, out: cfg.HandOff,
	}
}

// childEndsQueue bounds the ends of children waiting to be told to
// their parents; past it the reaper's sweep tells them.
const childEndsQueue = 1024

// Pool is the core's database.
func (c *Core) Pool() *pgxpool.Pool { return c.pool }

// Schema is the deployment's schema, which every statement of the core
// runs in (Schema.Q, and store.Begin's).
func (c *Core) Schema() *pgschema.Schema { return c.schema }

// Sealer seals and opens the sagas' data.
func (c *Core) Sealer() *seal.Sealer { return c.sealer }

// DB is the core's database in its schema.
func (c *Core) DB() pgschema.Executor { return c.schema.Q(c.pool) }

// Plan is the core's planner.
func (c *Core) Plan() plan.Planner { return c.plan }

// Metrics are the core's metrics.
func (c *Core) Metrics() *metrics.Metrics { return c.metrics }

// Tracer is the core's tracer.
func (c *Core) Tracer() *tracing.Tracer { return c.tracer }

// MaxInput bounds a saga's input, in bytes.
func (c *Core) MaxInput() int { return c.maxInput }

// Versions are the core's definitions, every version, by Ref; callers
// must not change the slice.
func (c *Core) Versions() []*saga.Definition { return c.all }

// Names are the names of the definitions this process runs, sorted;
// callers must not change the slice.
func (c *Core) Names() []string { return c.names }

// HandOffArg is the publish_after parameter of the core's outbox inserts
// (HandOff.PublishAfter), NULL for a client that runs no worker.
func (c *Core) HandOffArg() any { return c.handOffArg() }

// Sent hands rows a transaction committed to the hand-off.
func (c *Core) Sent(rows []outbox.Committed) { c.sent(rows) }

// handOffArg is the publish_after parameter of the core's outbox inserts
// (handOff.PublishAfter), NULL for a client that runs no worker.
func (c *Core) handOffArg() any {
	if c.out == nil {
		return nil
	}
	return c.out.PublishAfter()
}

// handOffFor is handOffArg for the rows tx writes: NULL in a caller's
// transaction (store.Within), whose commit this process does not see.
func (c *Core) handOffFor(tx *store.Tx) any {
	if tx.Nested() {
		return nil
	}
	return c.handOffArg()
}

// sent hands rows a transaction committed to the hand-off.
func (c *Core) sent(rows []outbox.Committed) {
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

func (c *Core) emit(fx *effects) {
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
func (c *Core) Moved(m *store.Move, created time.Time) {
	if !m.Finished {
		return
	}
	if c.children[m.Definition] {
		c.childEnded(m.Saga)
	}
	c.metrics.SagasFinished.WithLabelValues(m.Definition, m.Outcome).Inc()
	if !created.IsZero() {
		c.metrics.SagaDuration.WithLabelValues(m.Definition, m.Outcome).Observe(time.Since(created).Seconds())
	}
	if c.onFinished != nil {
		c.onFinished(m.Saga, m.Definition, m.To)
	}
}

// settled is what the inbox holds for a step the engine gives up.
type settled struct {
	outcome string
	unknown bool
	// verified: the step's Verify answered, after the last attempt whose
	// outcome was unknown, that the key took no effect.
	verified bool
	result   []byte
}

// effect is what is known of the effect of a step given up without
// success, from the step's row (possiblyDone) and what its key holds.
func (s settled) effect(possiblyDone bool) compensation.Effect {
	switch {
	case s.unknown:
		return compensation.PossiblyDone
	case s.verified:
		return compensation.VerifiedNotDone
	case possiblyDone:
		return compensation.PossiblyDone
	}
	return compensation.NotDone
}

// settle fences a step's key in the inbox, in tx (which holds the saga's
// lock): a tombstone unless the key holds a final outcome, so no delivery
// can take effect after tx commits; and it reads what the key holds. A key
// held by an attempt still running returns store.ErrBusy, without
// waiting on it: that attempt may be waiting on the saga tx holds.
func (c *Core) settle(ctx context.Context, tx *store.Tx, sagaID uuid.UUID, step string, phase saga.Phase) (settled, error) {
	return c.settleWith(ctx, tx, store.SettleTombstone, sagaID, step, phase)
}

// settleWith is settle with the tombstone statement given.
func (c *Core) settleWith(ctx context.Context, tx *store.Tx, tombstone string, sagaID uuid.UUID, step string, phase saga.Phase) (settled, error) {
	key := saga.StepKey(sagaID, step, phase)
	var got bool
	var s settled
	tx.Queue(tombstone, func(row pgx.Row) error { return row.Scan(&got) },
		pguuid.Of(sagaID), pguuid.Of(key), step, string(phase), store.LockID(key))
	found := true
	tx.Queue(store.SettleRead, func(row pgx.Row) error {
		err := row.Scan(&s.outcome, &s.unknown, &s.verified, &s.result)
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
func (c *Core) giveUp(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int, phase saga.Phase, attemptNo int, reason string, possiblyDone bool, fx *effects) error {
	step := def.Step(idx)
	s, err := c.settle(ctx, tx, sg.ID, step.Name, phase)
	if err != nil {
		return err
	}
	if s.outcome != "succeeded" && phase == saga.PhaseForward {
		if err := c.settleBranches(ctx, tx, sg, def, idx); err != nil {
			return err
		}
	}
	var m *store.Move
	if s.outcome == "succeeded" {
		c.log.Info("step given up had taken effect; applied as a success", "saga_id", sg.ID, "step", step.Name, "phase", phase, "attempt", attemptNo)
		m, err = c.plan.Success(sg, def, idx, phase, attemptNo, s.result)
	} else {
		m, err = c.plan.Failure(sg, def, idx, phase, attemptNo, reason, s.effect(possiblyDone))
	}
	if err != nil {
		return err
	}
	store.QueueMove(tx, m, c.handOffFor(tx), fx.moved(m))
	return nil
}

func outboxCommitted(id int64, subject, msgID string, payload []byte, headers map[string]string) outbox.Committed {
	return outbox.Committed{ID: id, Subject: subject, MsgID: msgID, Payload: payload, Headers: headers}
}

// withSteps reads sg's steps into sg.Steps, under the saga's lock that
// tx holds, when its definition has parallel groups: their moves depend
// on the other branches (plan.ErrNeedsSteps).
func (c *Core) withSteps(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition) error {
	if sg == nil || !def.HasGroups() {
		return nil
	}
	steps, err := store.ReadSteps(ctx, tx.Schema().Q(tx.Conn()), sg.ID)
	if err != nil {
		return err
	}
	sg.Steps = append(make([]saga.StepExecution, 0, len(steps)), steps...)
	return nil
}

// settleBranches settles the branches beside forward step idx, which is
// given up, that are still under way: each finishes the attempt it runs
// (store.ErrBusy until then: the caller tries again), then is settled
// through the inbox as settle does, and ended as what its key holds,
// succeeded, or failed and possibly done. sg.Steps is updated to match,
// for the compensation's walk.
func (c *Core) settleBranches(ctx context.Context, tx *store.Tx, sg *saga.Instance, def *saga.Definition, idx int) error {
	first, end := def.Group(idx)
	if end-first == 1 {
		return nil
	}
	for i := range sg.Steps {
		st := &sg.Steps[i]
		b := def.StepIndex(st.Step)
		if b < first || b >= end || b == idx || st.Phase != saga.PhaseForward ||
			st.Status != saga.StepDispatched && st.Status != saga.StepRetrying && st.Status != saga.StepWaiting {
			continue
		}
		s, err := c.settleWith(ctx, tx, store.SettleTombstoneForCancel, sg.ID, st.Step, saga.PhaseForward)
		if err != nil {
			return err
		}
		if s.outcome == "started" {
			return fmt.Errorf("settle branch %q of saga %s: its attempt %d is under way: %w", st.Step, sg.ID, st.Attempt, store.ErrBusy)
		}
		// A branch whose Verify found its key took no effect is undone
		// too when it has a compensation, as the step given up is
		// (plan.groupFailure): the compensation voids the key against a
		// request still on its way.
		effect := s.effect(st.PossiblyDone)
		status, possibly := saga.StepFailed, effect == compensation.PossiblyDone || effect == compensation.VerifiedNotDone && def.Step(b).Compensate != nil
		var result any
		if s.outcome == "succeeded" && len(s.result) > 0 {
			result = string(s.result)
		}
		if s.outcome == "succeeded" {
			// Its compensation's command carries its result.
			status, possibly = saga.StepSucceeded, false
			sg.Results = maps.Clone(sg.Results)
			if sg.Results == nil {
				sg.Results = map[string]json.RawMessage{}
			}
			sg.Results[st.Step] = json.RawMessage(s.result)
			if len(s.result) == 0 {
				sg.Results[st.Step] = json.RawMessage("null")
			}
		}
		var ended bool
		tx.Queue(store.EndBranch, func(row pgx.Row) error { return row.Scan(&ended) },
			pguuid.Of(sg.ID), st.Step, string(status), result, possibly)
		st.Status, st.PossiblyDone = status, st.PossiblyDone || possibly
	}
	return tx.Flush(ctx)
}
