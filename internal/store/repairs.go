package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/saga"
)

// Querier runs one statement: a connection, a pool or a pgx.Tx.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ReopenSaga moves saga id, read at version under its lock, back to running
// in state to (an operator's retry or skip); clearError clears its error.
// A miss is a bug: ErrInvariant.
func ReopenSaga(ctx context.Context, q Querier, id uuid.UUID, version int64, to saga.State, clearError bool) error {
	return touched(q.Exec(ctx, reopenSaga, pguuid.Of(id), version, string(to), clearError))
}

// CancelSaga moves saga id, read at version under its lock, to state to
// with the error errText, for an operator's cancel; finished ends it
// (nothing to compensate). It returns when the saga started.
func CancelSaga(ctx context.Context, q Querier, id uuid.UUID, version int64, to saga.State, errText string, finished bool) (created time.Time, err error) {
	err = q.QueryRow(ctx, cancelSaga, pguuid.Of(id), version, string(to), errText, finished).Scan(&created)
	if errors.Is(err, pgx.ErrNoRows) {
		err = fmt.Errorf("the saga moved under its lock: %w", ErrInvariant)
	}
	return created, err
}

// CloseSaga ends saga id, read at version under its lock, closed by an
// operator. A miss is a bug: ErrInvariant.
func CloseSaga(ctx context.Context, q Querier, id uuid.UUID, version int64) error {
	return touched(q.Exec(ctx, closeSaga, pguuid.Of(id), version))
}

// touched checks that a statement fenced under a saga's lock wrote its row.
func touched(tag pgconn.CommandTag, err error) error {
	if err == nil && tag.RowsAffected() == 0 {
		return fmt.Errorf("the saga moved under its lock: %w", ErrInvariant)
	}
	return err
}

// ClearFailedKey clears a failed step's key ($2) for an operator's retry: a
// database step's failure is deleted; an external step's key keeps what it
// knows (an unknown outcome stays unknown) as a retry the next attempt may
// claim.
const ClearFailedKey = `with x as (
  delete from idemsaga.inbox where saga_id = $1 and step_key = $2 and outcome in ('failed', 'tombstone') and not unknown
  returning 1
)
update idemsaga.inbox set outcome = 'retry' where saga_id = $1 and step_key = $2 and outcome in ('failed', 'tombstone') and unknown`

// reopenSaga moves a saga ($1, at version $2, read under its lock) back to
// running in state $3 for an operator's retry or skip; $4 clears its
// error.
const reopenSaga = `update idemsaga.sagas set state = $3, finished_at = null, version = version + 1, updated_at = idemsaga.now(),
  error = case when $4::bool then null else error end
where id = $1 and version = $2`

// DispatchCompensation dispatches the first compensation of a saga an
// operator cancels: the step's row ($2, index $3, key $4, lease $5 ms) and
// its command ($6-$10: subject, message id, payload, hand-off, headers).
// It returns the command's outbox id, no row when the step was there.
var DispatchCompensation = `with st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  values ($1, $2, 'compensate', $3, $4, 'dispatched', 1, idemsaga.now() + $5 * interval '1 millisecond', idemsaga.now())
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
)
` + outboxInsert(`select $6, $7, $8, saga_id, clock_timestamp() + $9 * interval '1 millisecond', $10::jsonb from st`) + ` returning id`

// cancelSaga moves a saga an operator cancels ($1 at version $2, read under
// its lock) to state $3 with the error $4; $5 finishes it (nothing to
// compensate). It returns when the saga started.
const cancelSaga = `update idemsaga.sagas set state = $3, error = $4, version = version + 1, updated_at = idemsaga.now(),
  finished_at = case when $5::bool then idemsaga.now() end
where id = $1 and version = $2 returning created_at`

// InsertRepair records an operator's repair of saga $1 under its request
// key, with the state the repair's writes left; queued after them.
const InsertRepair = `insert into idemsaga.repairs (saga_id, request_key, operation, request_hash, reason, requested_by, state_after, step, phase)
select id, $2, $3, $4, $5, $6, state, $7, $8 from idemsaga.sagas where id = $1
returning state_after, created_at`

// closeSaga ends a saga an operator closes ($1 at version $2, read under
// its lock).
const closeSaga = `update idemsaga.sagas set state = 'closed', finished_at = idemsaga.now(), version = version + 1, updated_at = idemsaga.now()
where id = $1 and version = $2`
