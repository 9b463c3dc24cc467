package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Client starts and reads sagas. It needs only the database: the first
// command goes into the outbox in the same transaction as the saga, and a
// relay publishes it.
type Client struct {
	c   *orchestrate.Core
	cfg Config
	// steps, if set, are the engine's step workers: Start runs a saga's
	// first database step in the transaction that starts it.
	steps *attempt.Runner

	mu      sync.Mutex
	checked bool
}

func (cl *Client) markChecked() {
	cl.mu.Lock()
	cl.checked = true
	cl.mu.Unlock()
}

// Check compares the client's shared settings (SubjectPrefix, LeaseGrace)
// and definitions with the deployment's, recording what it has not
// recorded yet, and returns ErrDeploymentMismatch on a difference: a
// client that would write commands on another subject prefix, or leases
// of another grace, must not start sagas. Start runs it until it once
// succeeds; call it at start-up to fail early.
func (cl *Client) Check(ctx context.Context) error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.checked {
		return nil
	}
	if err := checkDeployment(ctx, cl.c, &cl.cfg, false); err != nil {
		return err
	}
	cl.checked = true
	return nil
}

// Get returns the saga with the given ID, with its step executions.
func (cl *Client) Get(ctx context.Context, id uuid.UUID) (*saga.Instance, error) {
	sg, err := store.LoadSaga(ctx, cl.c.DB(), id, false)
	if err != nil {
		return nil, err
	}
	return sg, cl.full(ctx, sg)
}

// GetByKey returns the saga of def started with key, with its steps.
func (cl *Client) GetByKey(ctx context.Context, definition, key string) (*saga.Instance, error) {
	sg, err := store.ScanSaga(cl.c.DB().QueryRow(ctx, store.SelectSagaByKeyFull, definition, key))
	if err != nil {
		return nil, err
	}
	return sg, cl.full(ctx, sg)
}

// Lookup finds a saga by ID, or by idempotency key across definitions. A
// key used by several definitions is an error that lists them.
func (cl *Client) Lookup(ctx context.Context, idOrKey string) (*saga.Instance, error) {
	if id, err := uuid.Parse(idOrKey); err == nil {
		sg, err := cl.Get(ctx, id)
		if !errors.Is(err, saga.ErrNotFound) {
			return sg, err
		}
	}
	rows, err := cl.c.DB().Query(ctx, store.SelectSagasByKey, idOrKey)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: look up %q: %w", idOrKey, err)
	}
	var found []*saga.Instance
	for rows.Next() {
		sg, err := store.ScanSaga(rows)
		if err != nil {
			rows.Close()
			return nil, err
		}
		found = append(found, sg)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("idemsaga: look up %q: %w", idOrKey, err)
	}
	switch len(found) {
	case 0:
		return nil, fmt.Errorf("%w: no saga has ID or key %q", saga.ErrNotFound, idOrKey)
	case 1:
		return found[0], cl.full(ctx, found[0])
	default:
		names := make([]string, len(found))
		for i, f := range found {
			names[i] = f.Definition
		}
		return nil, fmt.Errorf("idemsaga: key %q names sagas of several definitions %v; use the saga ID", idOrKey, names)
	}
}

// querier reads rows: the client's pool, or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// loadSteps fills in what inspection shows of sg beyond its row (steps,
// attempts, callbacks, repairs, dead letters, children, pause), reading
// through q.
func (cl *Client) loadSteps(ctx context.Context, q querier, sg *saga.Instance) error {
	if err := cl.loadPause(ctx, q, sg); err != nil {
		return err
	}
	rows, err := q.Query(ctx, cl.c.Schema().SQL(store.SelectSteps), pguuid.Of(sg.ID))
	if err != nil {
		return fmt.Errorf("idemsaga: read steps of saga %s: %w", sg.ID, err)
	}
	defer rows.Close()
	def, _ := cl.c.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
	sg.Steps = sg.Steps[:0]
	for rows.Next() {
		var s saga.StepExecution
		var phase, status string
		if err := rows.Scan(&s.Step, &phase, &s.Index, &s.Key, &status, &s.Attempt, &s.PossiblyDone, &s.LeaseUntil,
			&s.NextAttemptAt, &s.LastError, &s.Result, &s.CreatedAt, &s.UpdatedAt); err != nil {
			return fmt.Errorf("idemsaga: read steps of saga %s: %w", sg.ID, err)
		}
		s.Phase, s.Status = saga.Phase(phase), saga.StepStatus(status)
		if def != nil && s.Index < def.Len() {
			s.Kind, s.Group = def.Step(s.Index).Kind.String(), def.Step(s.Index).Group
			if def.Step(s.Index).Kind == saga.CallbackStep && s.Phase == saga.PhaseForward {
				s.CallbackToken = saga.CallbackToken(sg.ID, s.Step)
			}
		}
		sg.Steps = append(sg.Steps, s)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("idemsaga: read steps of saga %s: %w", sg.ID, err)
	}
	sg.Steps = withSkipped(sg.Steps, sg.Skipped, def)
	if err := cl.loadChildren(ctx, q, sg); err != nil {
		return err
	}
	arows, err := q.Query(ctx, cl.c.Schema().SQL(store.SelectAttempts), pguuid.Of(sg.ID))
	if err != nil {
		return fmt.Errorf("idemsaga: read attempts of saga %s: %w", sg.ID, err)
	}
	defer arows.Close()
	sg.Attempts = sg.Attempts[:0]
	for arows.Next() {
		var a saga.StepAttempt
		var phase string
		if err := arows.Scan(&a.Step, &phase, &a.Attempt, &a.DispatchedAt, &a.FinishedAt, &a.Outcome, &a.Error); err != nil {
			return fmt.Errorf("idemsaga: read attempts of saga %s: %w", sg.ID, err)
		}
		a.Phase = saga.Phase(phase)
		a.Key = saga.StepKey(sg.ID, a.Step, a.Phase)
		sg.Attempts = append(sg.Attempts, a)
	}
	if err := arows.Err(); err != nil {
		return fmt.Errorf("idemsaga: read attempts of saga %s: %w", sg.ID, err)
	}
	crows, err := q.Query(ctx, cl.c.Schema().SQL(store.SelectCallbacks), pguuid.Of(sg.ID))
	if err != nil {
		return fmt.Errorf("idemsaga: read callbacks of saga %s: %w", sg.ID, err)
	}
	sg.Callbacks, err = pgx.CollectRows(crows, func(row pgx.CollectableRow) (saga.CallbackRecord, error) {
		var cb saga.CallbackRecord
		err := row.Scan(&cb.Step, &cb.EventID, &cb.Outcome, &cb.Failed, &cb.Result, &cb.Error, &cb.ReceivedAt, &cb.AppliedAt)
		return cb, err
	})
	if err != nil {
		return fmt.Errorf("idemsaga: read callbacks of saga %s: %w", sg.ID, err)
	}
	rrows, err := q.Query(ctx, cl.c.Schema().SQL(store.SelectRepairs), pguuid.Of(sg.ID))
	if err != nil {
		return fmt.Errorf("idemsaga: read repairs of saga %s: %w", sg.ID, err)
	}
	defer rrows.Close()
	sg.Repairs = sg.Repairs[:0]
	for rrows.Next() {
		var r saga.RepairRecord
		var phase, state string
		if err := rrows.Scan(&r.Operation, &r.Key, &r.Reason, &r.By, &r.Step, &phase, &state, &r.At); err != nil {
			return fmt.Errorf("idemsaga: read repairs of saga %s: %w", sg.ID, err)
		}
		r.Phase, r.StateAfter = saga.Phase(phase), saga.State(state)
		sg.Repairs = append(sg.Repairs, r)
	}
	if err := rrows.Err(); err != nil {
		return fmt.Errorf("idemsaga: read repairs of saga %s: %w", sg.ID, err)
	}
	sg.DeadLetters, err = queryDeadLetters(ctx, q, cl.c.Schema().SQL(store.ListDeadLetters), pguuid.Of(sg.ID), "", 0, 1000)
	return err
}

// ListOptions filters List. Zero fields do not filter.
type ListOptions struct {
	// Definition keeps sagas of this definition.
	Definition string
	// State keeps sagas in this state.
	State saga.State
	// OlderThan keeps sagas created longer ago than this.
	OlderThan time.Duration
	// Stuck keeps running sagas with no step in flight, or whose step's
	// lease or retry is overdue by more than StuckAfter.
	Stuck bool
	// StuckAfter is the overdue margin of Stuck. Defaults to StaleAfterDefault.
	StuckAfter time.Duration
	// Limit bounds the result. Defaults to 100.
	Limit int
	// Cursor continues a listing after the last saga of a page: pass
	// Cursor(last). Empty starts with the newest.
	Cursor string
	// DeadLettered keeps sagas with a command parked in the dead-letter
	// table (DeadLetters).
	DeadLettered bool
	// Version keeps sagas running this version of Definition (which it
	// needs).
	Version int
	// Key keeps the sagas started under this idempotency key: one per
	// definition at most.
	Key string
	// CreatedFrom and CreatedBefore keep sagas created at or after, and
	// before, these times (zero: no bound).
	CreatedFrom, CreatedBefore time.Time
	// Paused keeps running sagas held by a pause (their own or their
	// definition's).
	Paused bool
	// Waiting keeps running sagas with a step waiting for a callback or
	// a child saga.
	Waiting bool
	// OldestFirst lists the oldest first (the cursor then continues
	// towards the newest); the default is newest first.
	OldestFirst bool
}

// ErrInvalidFilter is returned by List for a definition or state that no
// saga can have: a typo must not read as "nothing to see".
var ErrInvalidFilter = errors.New("idemsaga: list sagas: invalid filter")

// checkFilter refuses a definition nobody recorded, and a state no
// definition (that one, at any version, or any) has.
func (cl *Client) checkFilter(ctx context.Context, opts ListOptions) error {
	if opts.Version < 0 || opts.Version > 0 && opts.Definition == "" {
		return fmt.Errorf("%w: version %d needs a definition, and versions start at 1", ErrInvalidFilter, opts.Version)
	}
	if opts.Definition != "" {
		if _, err := cl.c.Resolve(ctx, opts.Definition); errors.Is(err, saga.ErrUnknownDefinition) {
			return fmt.Errorf("%w: %w", ErrInvalidFilter, err)
		} else if err != nil {
			return err
		}
	}
	if opts.State == "" {
		return nil
	}
	// Every version: sagas of an older one may still be in its states.
	var defs []*saga.Definition
	descs, err := cl.Definitions(ctx)
	if err != nil {
		return err
	}
	for _, d := range descs {
		if opts.Definition == "" || d.Name == opts.Definition {
			def, err := cl.c.DefinitionAt(ctx, d.Name, d.Version)
			if err != nil {
				return err
			}
			defs = append(defs, def)
		}
	}
	for _, d := range cl.c.Versions() {
		if opts.Definition == "" || d.Name() == opts.Definition {
			defs = append(defs, d)
		}
	}
	states := map[string]bool{}
	for _, s := range []saga.State{saga.StateInit, saga.StateCompensating, saga.StateCompensated, saga.StateFailed, saga.StateParked, saga.StateClosed} {
		states[string(s)] = true
	}
	for _, d := range defs {
		if d.ValidState(opts.State) {
			return nil
		}
		for _, st := range d.Steps() {
			states[string(st.Reaches)] = true
		}
	}
	names := make([]string, 0, len(states))
	for s := range states {
		names = append(names, s)
	}
	slices.Sort(names)
	return fmt.Errorf("%w: no saga can be in state %q; the states are %s", ErrInvalidFilter, opts.State, strings.Join(names, ", "))
}

// ErrInvalidCursor is returned by List for a cursor Cursor did not make.
var ErrInvalidCursor = errors.New("idemsaga: list sagas: invalid cursor")

// Cursor returns the cursor that continues a listing after sg.
func Cursor(sg *saga.Instance) string {
	return sg.CreatedAt.UTC().Format(time.RFC3339Nano) + "_" + sg.ID.String()
}

func parseCursor(c string) (*time.Time, pgtype.UUID, error) {
	if c == "" {
		return nil, pgtype.UUID{}, nil
	}
	at, id, ok := strings.Cut(c, "_")
	t, terr := time.Parse(time.RFC3339Nano, at)
	u, uerr := uuid.Parse(id)
	if !ok || terr != nil || uerr != nil {
		return nil, pgtype.UUID{}, fmt.Errorf("%w: %q is not one List's caller got from Cursor; start again without one", ErrInvalidCursor, c)
	}
	return &t, pguuid.Of(u), nil
}

// Counts returns how many sagas are in each state, of one definition or
// of all (definition ""). It reads the whole table: for dashboards, use
// the sagas_started_total and sagas_finished_total metrics.
func (cl *Client) Counts(ctx context.Context, definition string) (map[saga.State]int64, error) {
	rows, err := cl.c.DB().Query(ctx, store.CountSagas, definition)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: count sagas: %w", err)
	}
	defer rows.Close()
	out := map[saga.State]int64{}
	for rows.Next() {
		var st string
		var n int64
		if err := rows.Scan(&st, &n); err != nil {
			return nil, fmt.Errorf("idemsaga: count sagas: %w", err)
		}
		out[saga.State(st)] = n
	}
	return out, rows.Err()
}

// List returns sagas matching opts, newest first, without their steps.
func (cl *Client) List(ctx context.Context, opts ListOptions) ([]*saga.Instance, error) {
	if opts.Limit <= 0 {
		opts.Limit = 100
	}
	if opts.StuckAfter <= 0 {
		opts.StuckAfter = StaleAfterDefault
	}
	after, afterID, err := parseCursor(opts.Cursor)
	if err != nil {
		return nil, err
	}
	if err := cl.checkFilter(ctx, opts); err != nil {
		return nil, err
	}
	if !opts.CreatedFrom.IsZero() && !opts.CreatedBefore.IsZero() && !opts.CreatedFrom.Before(opts.CreatedBefore) {
		return nil, fmt.Errorf("%w: created from %s is not before %s", ErrInvalidFilter, opts.CreatedFrom.Format(time.RFC3339), opts.CreatedBefore.Format(time.RFC3339))
	}
	var query string
	switch {
	case opts.Key != "" && opts.OldestFirst:
		query = store.ListSagasByKeyOldestFirst
	case opts.Key != "":
		query = store.ListSagasByKey
	case opts.OldestFirst:
		query = store.ListSagasOldestFirst
	default:
		query = store.ListSagas
	}
	rows, err := cl.c.DB().Query(ctx, query, opts.Definition, string(opts.State), opts.OlderThan.Seconds(), opts.Stuck, opts.StuckAfter.Seconds(), opts.Limit, after, afterID,
		opts.DeadLettered, opts.Version, opts.Key, optionalTime(opts.CreatedFrom), optionalTime(opts.CreatedBefore), opts.Paused, opts.Waiting)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list sagas: %w", err)
	}
	defer rows.Close()
	var out []*saga.Instance
	for rows.Next() {
		sg, err := store.ScanSaga(rows)
		if err != nil {
			return nil, err
		}
		if err := cl.open(sg); err != nil {
			return nil, err
		}
		out = append(out, sg)
	}
	return out, rows.Err()
}

// full reads the rest of sg (loadSteps) and opens its data.
func (cl *Client) full(ctx context.Context, sg *saga.Instance) error {
	if err := cl.loadSteps(ctx, cl.c.Pool(), sg); err != nil {
		return err
	}
	return cl.open(sg)
}

// open opens sg's data, sealed at rest with a Codec: its input, its
// results, its steps' and callbacks' results. A client without a Codec
// (an admin tool) leaves them sealed.
func (cl *Client) open(sg *saga.Instance) error { return cl.c.Sealer().OpenInstance(sg) }

// Wait polls the saga until it reaches a terminal state or ctx ends.
func (cl *Client) Wait(ctx context.Context, id uuid.UUID) (*saga.Instance, error) {
	delay := 2 * time.Millisecond
	for {
		sg, err := store.LoadSaga(ctx, cl.c.DB(), id, false)
		if err != nil {
			return nil, err
		}
		if sg.Finished() {
			return sg, cl.full(ctx, sg)
		}
		select {
		case <-ctx.Done():
			return sg, fmt.Errorf("idemsaga: saga %s still %q: %w", id, sg.State, ctx.Err())
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// withSkipped places the saga's skipped steps among its step executions,
// each after the forward steps before it in the definition.
func withSkipped(steps []saga.StepExecution, skipped []string, def *saga.Definition) []saga.StepExecution {
	for _, name := range skipped {
		idx := -1
		kind, group := "", ""
		if def != nil {
			if idx = def.StepIndex(name); idx >= 0 {
				kind, group = def.Step(idx).Kind.String(), def.Step(idx).Group
			}
		}
		at := 0
		for i, s := range steps {
			if s.Phase == saga.PhaseForward && s.Index < idx {
				at = i + 1
			}
		}
		steps = slices.Insert(steps, at, saga.StepExecution{Step: name, Phase: saga.PhaseForward, Index: idx, Kind: kind, Group: group, Status: saga.StepSkipped})
	}
	return steps
}

// optionalTime is t, or nil (SQL null) for the zero time.
func optionalTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}
