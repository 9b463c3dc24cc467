package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/startlock"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/tracing"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

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
	row := store.FirstStep{Saga: id, Step: first.Name, Key: saga.StepKey(id, first.Name, saga.PhaseForward), LeaseMillis: cl.c.Plan().LeaseMillis(first.Retry)}
	ok, err := cl.steps.Carry(startlock.Without(ctx), outbox.Committed{Subject: subject, MsgID: msgID, Payload: payload, Headers: trace}, row, func(tx *store.Tx) func() bool {
		tx.Queue(stmt, func(row pgx.Row) error {
			var outboxID *int64
			err := row.Scan(&inserted, &outboxID, &existing, &hash, &state, &got)
			ran = err == nil
			return err
		}, pguuid.Of(id), def.Name(), key, sum, string(input),
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
