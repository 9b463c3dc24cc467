package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/attempt"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/startlock"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/outbox"
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

// StartResult is what Start returns.
type StartResult struct {
	// ID identifies the saga.
	ID uuid.UUID
	// State is the saga's state when Start returned.
	State saga.State
	// Duplicate is true when the key already named a saga with the same
	// input: nothing was written and ID is that saga's.
	Duplicate bool
}

// Start creates a saga of def for the business intent key, with input
// encoded as JSON, and enqueues its first step, in one transaction. When
// the client is an engine's that runs def and the first step is a
// database step, that transaction also runs the step's first attempt
// (one commit for both, no message): Start then returns once the step's
// outcome committed, and its time includes the handler's. A caller whose
// ctx ends first gets an error at once; the saga may still start, and
// the same key tells.
//
// Same key and same input: the existing saga is returned with Duplicate
// set, and nothing is written. Same key, different input:
// saga.ErrIdempotencyKeyReused, and nothing is written. Any number of
// concurrent calls with one key create one saga.
//
// A key with SubmitTokenPrefix is a submit token (IssueToken): the start
// consumes it in the same transaction, and one never issued for def, or
// expired unused, is refused with ErrSubmitTokenInvalid, nothing written.
// Once it started a saga it is that saga's key, as above.
func (cl *Client) Start(ctx context.Context, def *saga.Definition, key string, input any) (StartResult, error) {
	// Without the caller's transaction the start is one statement, which
	// PostgreSQL runs as its own transaction: one round trip. (A saga that
	// starts with a parallel group takes a transaction of its own.)
	res, sent, err := cl.start(ctx, cl.c.Pool(), def, key, input, cl.c.HandOffArg())
	if err != nil {
		return res, err
	}
	if err := failpoint.Inject(failpoint.StartAfterCommit); err != nil {
		return StartResult{}, fmt.Errorf("idemsaga: start saga: the answer was lost after commit; retry with the same key: %w", err)
	}
	cl.c.Sent(sent)
	return res, nil
}

// StartTx is Start inside the caller's transaction, so the saga starts if
// and only if the caller's business writes commit. The transaction must
// run at READ COMMITTED (PostgreSQL's default) for concurrent starts of one
// key to resolve to one saga. Metrics count the start even if the caller
// later rolls back.
func (cl *Client) StartTx(ctx context.Context, tx pgx.Tx, def *saga.Definition, key string, input any) (StartResult, error) {
	// The commit is the caller's: the first command is the relay's to
	// publish (no hand-off), at its next poll.
	res, _, err := cl.start(ctx, tx, def, key, input, nil)
	return res, err
}

// start runs the start statement on q, in a span of its own when the
// client traces. handOff is the command's publish_after in milliseconds,
// nil for the relay to publish it; the row is returned for a publish after
// commit.
func (cl *Client) start(ctx context.Context, q store.Row, def *saga.Definition, key string, input any, handOff any) (StartResult, []outbox.Committed, error) {
	tr := cl.c.Tracer()
	if !tr.Enabled() {
		return cl.startTraced(ctx, q, def, key, input, handOff, nil)
	}
	name, version := "", 0
	if def != nil {
		name, version = def.Name(), def.Version()
	}
	ctx, sp := tr.StartSaga(ctx, name, version)
	res, sent, err := cl.startTraced(ctx, q, def, key, input, handOff, tr.Headers(ctx))
	if res.ID != uuid.Nil {
		sp.SetAttributes(tracing.AttrSagaID.String(res.ID.String()))
	}
	outcome, spanErr := "started", err
	switch {
	case errors.Is(err, startlock.ErrHeld):
		// The API's 409, a normal outcome.
		outcome, spanErr = "held", nil
	case err != nil:
		outcome = "error"
	case res.Duplicate:
		outcome = "duplicate"
	}
	sp.SetAttributes(tracing.AttrDuplicate.Bool(res.Duplicate))
	sp.End(outcome, spanErr)
	return res, sent, err
}

// startTraced is start; trace is the start span's context, recorded with
// the saga and carried by its first command, nil when not traced.
func (cl *Client) startTraced(ctx context.Context, q store.Row, def *saga.Definition, key string, input any, handOff any, trace map[string]string) (StartResult, []outbox.Committed, error) {
	if def == nil {
		return StartResult{}, nil, errors.New("idemsaga: start saga: definition is nil")
	}
	if err := cl.Check(ctx); err != nil {
		return StartResult{}, nil, err
	}
	// The saga runs the version given, as this process or the deployment
	// knows it.
	registered, err := cl.c.DefinitionAt(ctx, def.Name(), def.Version())
	if err != nil {
		return StartResult{}, nil, err
	}
	if def != registered && def.Describe().Fingerprint() != registered.Describe().Fingerprint() {
		return StartResult{}, nil, fmt.Errorf("%w: definition %s given to Start differs from the one this client uses (%s)", ErrDeploymentMismatch, def.Ref(),
			describeDifference(registered.Describe(), def.Describe()))
	}
	if err := saga.CheckKey(key); err != nil {
		return StartResult{}, nil, err
	}
	// The caller's own definition knows the input type; one rebuilt from
	// the deployment's record checks the JSON only.
	checker := registered
	if def.Runnable() {
		checker = def
	}
	canonical, err := checker.Input(input)
	if err != nil {
		return StartResult{}, nil, err
	}
	if len(canonical) > cl.c.MaxInput() {
		return StartResult{}, nil, &saga.InputError{Definition: def.Name(), Problem: fmt.Sprintf("it is %d bytes, over the %d-byte limit (Config.MaxInputBytes); keep large payloads elsewhere and pass a reference", len(canonical), cl.c.MaxInput())}
	}
	sum := sha256.Sum256(canonical)

	id, err := uuid.NewV7()
	if err != nil {
		return StartResult{}, nil, fmt.Errorf("idemsaga: start saga: new id: %w", err)
	}
	// The input is hashed as sent, and kept (and carried by commands)
	// sealed, with a Codec.
	stored, err := cl.c.Sealer().Seal(id, canonical)
	if err != nil {
		return StartResult{}, nil, err
	}
	sg := &saga.Instance{ID: id, Definition: def.Name(), DefinitionVersion: registered.Version(), Key: key, State: saga.StateInit, Version: 1, Input: stored}
	subject, msgID, payload, err := cl.c.Plan().Command(sg, registered, 0, saga.PhaseForward, 1, false)
	if err != nil {
		return StartResult{}, nil, err
	}
	stmt := store.StartStatement(IsSubmitToken(key), startlock.Arg(ctx, def.Name(), key) != nil, true)
	_, firstEnd := registered.Group(0)
	if _, inTx := q.(pgx.Tx); firstEnd > 1 && !inTx {
		// The first group's branches are written with the saga: a
		// transaction, begun only now, so that it never holds a
		// connection while the checks above take another.
		pool, ok := q.(interface {
			Begin(context.Context) (pgx.Tx, error)
		})
		if !ok {
			return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: a saga that starts with a parallel group starts in a transaction", def.Name(), key)
		}
		own, err := pool.Begin(ctx)
		if err != nil {
			return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: %w", def.Name(), key, err)
		}
		defer func() { _ = own.Rollback(context.WithoutCancel(ctx)) }()
		res, sent, err := cl.insertSaga(ctx, own, stmt, def, registered, sg, key, sum[:], stored, subject, msgID, payload, handOff, trace)
		if err != nil {
			return res, nil, err
		}
		if err := own.Commit(ctx); err != nil {
			return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: commit: %w; start it again with the same key", def.Name(), key, err)
		}
		return res, sent, nil
	}
	if _, own := q.(*pgxpool.Pool); own && cl.steps != nil {
		res, answered, err := cl.carry(ctx, def, registered, sg, key, sum[:], stored, subject, msgID, payload, trace)
		if answered || err != nil {
			return res, nil, err
		}
	}
	return cl.insertSaga(ctx, q, stmt, def, registered, sg, key, sum[:], stored, subject, msgID, payload, handOff, trace)
}

// carry starts sg in the transaction of its first step's first attempt,
// run here (attempt.Runner.Carry): one commit for both, and no command
// row. answered is false when that left nothing committed (or cannot
// tell) and the start statement did not tell a duplicate: the start then
// goes on alone, and a saga it finds under the key with sg's ID is this
// start's. A duplicate, a key reused and a key held are answered from
// what the start statement saw, without a second one.
func (cl *Client) carry(ctx context.Context, def, registered *saga.Definition, sg *saga.Instance, key string, sum, input []byte,
	subject, msgID string, payload []byte, trace map[string]string) (res StartResult, answered bool, err error) {
	id, first := sg.ID, registered.Step(0)
	lock := startlock.Arg(ctx, def.Name(), key)
	stmt := store.StartStatement(IsSubmitToken(key), lock != nil, false)
	// What the start statement saw, once it ran (read only after Carry
	// returned without ctx's end: its attempt has sent on then).
	var (
		ran, got bool
		inserted int
		existing *uuid.UUID
		hash     []byte
		state    *string
	)
	// The attempt keeps ctx's values (its trace), but not the lock's
	// mark: its handler's own starts try no lock.
	ok, err := cl.steps.Carry(startlock.Without(ctx), outbox.Committed{Subject: subject, MsgID: msgID, Payload: payload, Headers: trace}, func(tx *store.Tx) func() bool {
		tx.Queue(stmt, func(row pgx.Row) error {
			var outboxID *int64
			err := row.Scan(&inserted, &outboxID, &existing, &hash, &state, &got)
			ran = err == nil
			return err
		}, pguuid.Of(id), def.Name(), key, sum, string(input),
			first.Name, pguuid.Of(saga.StepKey(id, first.Name, saga.PhaseForward)), cl.c.Plan().LeaseMillis(first.Retry),
			store.DeadlineArg(def), registered.Version(), store.HeadersJSON(trace), lock)
		return func() bool { return inserted == 1 }
	})
	switch {
	case err != nil:
		return StartResult{}, false, fmt.Errorf("idemsaga: start saga %q key %q: %w; it may have started: start it again with the same key", def.Name(), key, err)
	case ok:
		cl.c.Metrics().Deliveries.WithLabelValues(metrics.LayerStart).Inc()
		cl.c.Metrics().SagasStarted.WithLabelValues(def.Name()).Inc()
		return StartResult{ID: id, State: saga.StateInit}, true, nil
	case !ran || inserted != 0:
		return StartResult{}, false, nil
	case !got:
		return StartResult{}, true, fmt.Errorf("idemsaga: start saga %q key %q: %w", def.Name(), key, startlock.ErrHeld)
	case existing == nil || state == nil:
		// The saga under the key committed while the insert waited for
		// it, or a token was not consumed: the start alone tells.
		return StartResult{}, false, nil
	}
	cl.c.Metrics().Deliveries.WithLabelValues(metrics.LayerStart).Inc()
	res, err = cl.duplicate(def, key, id, sum, *existing, hash, saga.State(*state))
	return res, true, err
}

// insertSaga runs the start statement stmt on q for saga sg and
// adjudicates a duplicate; a saga that starts with a parallel group also
// dispatches the group's other branches, on q, a transaction.
func (cl *Client) insertSaga(ctx context.Context, q store.Row, stmt string, def, registered *saga.Definition, sg *saga.Instance, key string, sum, input []byte,
	subject, msgID string, payload []byte, handOff any, trace map[string]string) (StartResult, []outbox.Committed, error) {
	id, first := sg.ID, registered.Step(0)
	var inserted int
	var outboxID *int64
	// What the statement saw under the key, for a duplicate.
	var (
		existing *uuid.UUID
		hash     []byte
		state    *string
		got      bool
	)
	err := q.QueryRow(ctx, cl.c.Schema().SQL(stmt), pguuid.Of(id), def.Name(), key, sum, string(input),
		first.Name, pguuid.Of(saga.StepKey(id, first.Name, saga.PhaseForward)), cl.c.Plan().LeaseMillis(first.Retry),
		store.DeadlineArg(def), registered.Version(), store.HeadersJSON(trace), startlock.Arg(ctx, def.Name(), key),
		subject, msgID, payload, handOff).Scan(&inserted, &outboxID, &existing, &hash, &state, &got)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "40001" {
		return StartResult{}, nil, fmt.Errorf("%w: start saga %q key %q collided with a concurrent start under REPEATABLE READ or SERIALIZABLE; run StartTx at READ COMMITTED, or retry the transaction", saga.ErrConflict, def.Name(), key)
	}
	if err != nil {
		return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: %w", def.Name(), key, err)
	}
	if !got {
		return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: %w", def.Name(), key, startlock.ErrHeld)
	}
	cl.c.Metrics().Deliveries.WithLabelValues(metrics.LayerStart).Inc()
	if inserted == 0 {
		// The unique key already names a saga (committed, since an
		// uncommitted one would have made us wait), or the key is a
		// submit token that could not be consumed: adjudicate by input.
		// The statement saw the saga unless it committed while the insert
		// (or the token's update) waited for it; then read it now.
		if existing == nil || state == nil {
			existing, state = new(uuid.UUID), new(string)
			err := q.QueryRow(ctx, cl.c.Schema().SQL(store.SelectSagaByKey), def.Name(), key).Scan(existing, &hash, state)
			if errors.Is(err, pgx.ErrNoRows) && IsSubmitToken(key) {
				// The token was not consumed, and started no saga.
				return StartResult{}, nil, explainSubmitToken(ctx, q, cl.c.Schema(), def.Name(), key)
			}
			if err != nil {
				return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: read existing saga: %w", def.Name(), key, err)
			}
		}
		res, err := cl.duplicate(def, key, id, sum, *existing, hash, saga.State(*state))
		return res, nil, err
	}
	var sent []outbox.Committed
	if outboxID != nil {
		sent = []outbox.Committed{{ID: *outboxID, Subject: subject, MsgID: msgID, Payload: payload, Headers: trace}}
	}
	if _, end := registered.Group(0); end > 1 {
		// The first group's other branches, in the same transaction.
		outer, ok := q.(pgx.Tx)
		if !ok {
			return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: a saga that starts with a parallel group starts in a transaction", def.Name(), key)
		}
		btx := store.Within(outer, cl.c.Schema())
		btx.SetTrace(trace)
		var branches []*store.Dispatch
		for b := 1; b < end; b++ {
			d, err := cl.c.Plan().Dispatch(sg, registered, b, saga.PhaseForward)
			if err != nil {
				return StartResult{}, nil, err
			}
			branches = append(branches, d)
		}
		store.QueueBranches(btx, id, branches, handOff)
		if err := btx.Flush(ctx); err != nil {
			return StartResult{}, nil, fmt.Errorf("idemsaga: start saga %q key %q: dispatch its first group: %w", def.Name(), key, err)
		}
		sent = append(sent, btx.Published()...)
	}
	cl.c.Metrics().SagasStarted.WithLabelValues(def.Name()).Inc()
	return StartResult{ID: id, State: saga.StateInit}, sent, nil
}

// duplicate adjudicates the start of saga id under key, which found the
// saga existing (its input's hash and state) there instead.
func (cl *Client) duplicate(def *saga.Definition, key string, id uuid.UUID, sum []byte, existing uuid.UUID, hash []byte, state saga.State) (StartResult, error) {
	if existing == id {
		// This start's own saga: it committed with its first step
		// (carry), whose commit's answer was lost.
		cl.c.Metrics().SagasStarted.WithLabelValues(def.Name()).Inc()
		return StartResult{ID: id, State: state}, nil
	}
	cl.c.Metrics().UniqueConflicts.WithLabelValues("sagas").Inc()
	if !bytes.Equal(hash, sum) {
		cl.c.Metrics().KeyReused.WithLabelValues(def.Name()).Inc()
		return StartResult{ID: existing}, fmt.Errorf("%w (definition %q, key %q, existing saga %s)", saga.ErrIdempotencyKeyReused, def.Name(), key, existing)
	}
	cl.c.Metrics().Duplicates.WithLabelValues(metrics.LayerStart).Inc()
	return StartResult{ID: existing, State: state, Duplicate: true}, nil
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
