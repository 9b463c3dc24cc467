package store

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// The statements of parallel groups: the branches a move dispatches
// beside its first, and a branch ended when its group is given up.

// dispatchBranches dispatches, for saga $1, the steps of the arrays $2
// (names), $3 (phase), $4 (indexes), $5 (keys), $6 (leases in
// milliseconds), each with its command ($7 subjects, $8 message ids, $9
// payloads, $10 headers as JSON text), at attempt 1; $11 is the
// commands' hand-off (NULL: the relay's). A step whose row exists is
// left alone, and its command is not written. It returns the commands'
// outbox ids and message ids.
var dispatchBranches = `with b as (
  select * from unnest($2::text[], $4::int[], $5::uuid[], $6::bigint[], $7::text[], $8::text[], $9::bytea[], $10::text[])
    as b(step, step_index, key, lease, subject, msg_id, payload, headers)
), st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select $1, b.step, $3, b.step_index, b.key, 'dispatched', 1, idemsaga.now() + b.lease * interval '1 millisecond', idemsaga.now()
  from b
  on conflict (saga_id, step, phase) do nothing
  returning step
), o as (
  ` + outboxInsert(`select b.subject, b.msg_id, b.payload, $1, clock_timestamp() + $11::bigint * interval '1 millisecond', b.headers::jsonb
  from b join st on st.step = b.step`) + `
  returning id, msg_id
)
select coalesce(array_agg(id), '{}'), coalesce(array_agg(msg_id), '{}') from o`

// QueueBranches queues, on tx, the dispatch of the steps ds of saga id
// (one phase), and records their commands on tx as sent.
func QueueBranches(tx *Tx, id uuid.UUID, ds []*Dispatch, handOff any) {
	if len(ds) == 0 {
		return
	}
	names, indexes, keys, leases := make([]string, len(ds)), make([]int32, len(ds)), make([]pgtype.UUID, len(ds)), make([]int64, len(ds))
	subjects, msgIDs, payloads, headers := make([]string, len(ds)), make([]string, len(ds)), make([][]byte, len(ds)), make([]*string, len(ds))
	for i, d := range ds {
		if d.Headers == nil {
			d.Headers = tx.trace
		}
		names[i], indexes[i], keys[i], leases[i] = d.Step, int32(d.Index), pguuid.Of(d.Key), d.LeaseMillis
		subjects[i], msgIDs[i], payloads[i] = d.Subject, d.MsgID, d.Payload
		if h, ok := HeadersJSON(d.Headers).(string); ok {
			headers[i] = &h
		}
	}
	tx.Queue(dispatchBranches, func(row pgx.Row) error {
		var ids []int64
		var sentIDs []string
		if err := row.Scan(&ids, &sentIDs); err != nil {
			return fmt.Errorf("dispatch the branches of saga %s: %w", id, err)
		}
		for i, msgID := range sentIDs {
			for _, d := range ds {
				if d.MsgID == msgID {
					tx.Sent(outbox.Committed{ID: ids[i], Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers})
				}
			}
		}
		return nil
	}, pguuid.Of(id), names, string(ds[0].Phase), indexes, keys, leases, subjects, msgIDs, payloads, headers, handOff)
}

// EndBranch ends forward step $2 of saga $1, still under way when its
// group was given up and settled through the inbox: status $3
// (succeeded or failed), result $4, possibly done $5. Its attempt's
// timeline row is closed, and a success's result goes to the saga's
// results, as a move's does (the saga's version is the move's to bump).
// It returns whether a row was ended.
const EndBranch = `with f as (
  update idemsaga.steps set status = $3, result = $4::jsonb, possibly_done = possibly_done or $5,
    lease_until = null, next_attempt_at = null, updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = 'forward' and status in ('dispatched', 'retrying', 'waiting')
  returning saga_id, step, phase, attempt
), r as (
  update idemsaga.sagas set results = results || jsonb_build_object($2::text, coalesce($4::jsonb, 'null'::jsonb))
  where id = $1 and $3 = 'succeeded' and exists (select from f)
), a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, idemsaga.now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then $3 else x.outcome end
  from f where x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
)
select exists (select from f)`

// rowsReader reads rows.
type rowsReader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ReadSteps reads saga id's step executions (SelectSteps), without their
// kinds or callback tokens.
func ReadSteps(ctx context.Context, q rowsReader, id uuid.UUID) ([]saga.StepExecution, error) {
	rows, err := q.Query(ctx, SelectSteps, pguuid.Of(id))
	if err != nil {
		return nil, fmt.Errorf("read the steps of saga %s: %w", id, err)
	}
	defer rows.Close()
	var out []saga.StepExecution
	for rows.Next() {
		var s saga.StepExecution
		var phase, status string
		if err := rows.Scan(&s.Step, &phase, &s.Index, &s.Key, &status, &s.Attempt, &s.PossiblyDone, &s.LeaseUntil,
			&s.NextAttemptAt, &s.LastError, &s.Result, &s.CreatedAt, &s.UpdatedAt); err != nil {
			return nil, fmt.Errorf("read the steps of saga %s: %w", id, err)
		}
		s.Phase, s.Status = saga.Phase(phase), saga.StepStatus(status)
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the steps of saga %s: %w", id, err)
	}
	return out, nil
}
