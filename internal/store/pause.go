package store

import (
	"context"
	"errors"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
)

// The statements of pause, resume and saga deadlines.

// pauseSaga pauses saga $1; a saga paused already is left as it is.
const pauseSaga = `update idemsaga.sagas set paused_at = idemsaga.now(), updated_at = idemsaga.now() where id = $1 and paused_at is null`

// resumeSaga resumes saga $1, returning when it was paused; no row when
// it was not.
const resumeSaga = `update idemsaga.sagas s set paused_at = null, updated_at = idemsaga.now()
from (select paused_at from idemsaga.sagas where id = $1) old
where s.id = $1 and s.paused_at is not null returning old.paused_at`

// ResendSteps marks the steps in flight of a resumed saga ($1) to be
// sent again at their attempt: a dispatched step with a next attempt
// time is one the reaper sends again (ResendDue), never one whose
// lease it takes over. A callback step that waits gets the time the
// saga was paused (since $2) added to its wait: its wait was held too.
const ResendSteps = `update idemsaga.steps set
  next_attempt_at = case when status = 'dispatched' then idemsaga.now() else next_attempt_at end,
  lease_until = case when status = 'waiting' then lease_until + (idemsaga.now() - $2::timestamptz) else lease_until end,
  updated_at = idemsaga.now()
where saga_id = $1 and status in ('dispatched', 'waiting')`

// ResendDefinition is ResendSteps for every running saga of a resumed
// definition ($1, paused since $2) that is not paused on its own, each under its
// saga's lock (taken first, as every writer of a step does). It
// returns how many sagas it resumed.
const ResendDefinition = `with s as (
  select id from idemsaga.sagas where definition = $1 and finished_at is null and paused_at is null
  order by id for no key update
), st as (
  update idemsaga.steps set
    next_attempt_at = case when status = 'dispatched' then idemsaga.now() else next_attempt_at end,
    lease_until = case when status = 'waiting' then lease_until + (idemsaga.now() - $2::timestamptz) else lease_until end,
    updated_at = idemsaga.now()
  where saga_id in (select id from s) and status in ('dispatched', 'waiting')
)
select count(*) from s`

// SelectPause reads why a saga is held, and its deadline.
const SelectPause = `select s.paused_at, p.paused_at, s.deadline_at from idemsaga.sagas s
left join idemsaga.paused_definitions p on p.definition = s.definition where s.id = $1`

// ResendDue finds the steps of resumed sagas to send again, for the
// definitions this process runs ($2).
const ResendDue = `select st.saga_id, st.step, st.phase::text from idemsaga.steps st
where st.status = 'dispatched' and st.next_attempt_at is not null and st.next_attempt_at <= idemsaga.now()
  and exists (select 1 from idemsaga.sagas s where s.id = st.saga_id and s.definition || '@' || s.definition_version = any($2) and ` + NotPaused + `)
order by st.next_attempt_at limit $1`

// resendStep sends a step of a resumed saga again at the attempt seen
// ($4), with a fresh lease ($5 ms) and no claim (the copy sent before
// the pause was refused by its claim, so its lease must not count), bumps the saga's version ($6,
// seen under its lock) and writes the command ($7-$10, and $11 its
// headers). It returns the command's outbox id.
var resendStep = `with r as (
  update idemsaga.steps set lease_until = idemsaga.now() + $5 * interval '1 millisecond', next_attempt_at = null, claimed_attempt = null, resent_attempt = null, updated_at = idemsaga.now()
  where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched' and next_attempt_at is not null
  returning saga_id
), v as (
  update idemsaga.sagas set version = version + 1, updated_at = idemsaga.now()
  where id = $1 and version = $6 and exists (select 1 from r)
  returning id
), o as (
  ` + outboxInsert(`select $7, $8, $9, id, clock_timestamp() + $10 * interval '1 millisecond', $11::jsonb from v`) + `
  returning id
)
select (select id from o),
  case when exists (select 1 from r) and not exists (select 1 from v) then idemsaga.invariant_broken('the resend of step ' || $2 || ' (' || $3 || ') of saga ' || $1::text || ' found its saga moved under its lock') end`

// DeadlinePassed finds the running sagas past their deadline, of the
// definitions this process runs ($2): not those compensating already,
// nor paused ones.
const DeadlinePassed = `select s.id from idemsaga.sagas s
where s.finished_at is null and s.deadline_at <= idemsaga.now() and s.state <> 'compensating'
  and s.definition || '@' || s.definition_version = any($2) and ` + NotPaused + `
order by s.deadline_at limit $1`

// CountPaused counts the running sagas held, by definition: those
// paused on their own (a partial index finds them) and those of a
// paused definition.
const CountPaused = `select definition, count(*) from (
  select id, definition from idemsaga.sagas where paused_at is not null and finished_at is null
  union
  select s.id, s.definition from idemsaga.paused_definitions p join idemsaga.sagas s on s.definition = p.definition and s.finished_at is null
) held group by definition`

// clearDeadline clears the deadline of saga $1.
const clearDeadline = `update idemsaga.sagas set deadline_at = null where id = $1 and deadline_at is not null`

// InsertDefinitionRepair records a pause or resume of a definition under its
// request key first: a concurrent request under the same key waits on it,
// then finds it. It returns whether it inserted, and when.
const InsertDefinitionRepair = `with i as (
  insert into idemsaga.definition_repairs (definition, request_key, operation, request_hash, reason, requested_by, sagas)
  values ($1, $2, $3, $4, $5, $6, 0)
  on conflict (definition, request_key) do nothing
  returning created_at
)
select exists (select 1 from i), coalesce((select created_at from i), idemsaga.now())`

// PauseDefinition pauses a definition; a definition paused already is
// left as it is (no row).
const PauseDefinition = `insert into idemsaga.paused_definitions (definition, request_key, reason, requested_by) values ($1, $2, $3, $4)
on conflict (definition) do nothing`

// ResumeDefinition resumes a definition, returning since when it was
// paused; no row when it was not.
const ResumeDefinition = `delete from idemsaga.paused_definitions where definition = $1 returning paused_at`

// CountDefinitionRepair records how many sagas a definition's pause or
// resume touched.
const CountDefinitionRepair = `update idemsaga.definition_repairs set sagas = $3 where definition = $1 and request_key = $2`

// PauseSaga pauses saga id; paused is false when it was paused already.
func PauseSaga(ctx context.Context, q Querier, id uuid.UUID) (paused bool, err error) {
	tag, err := q.Exec(ctx, pauseSaga, pguuid.Of(id))
	return err == nil && tag.RowsAffected() > 0, err
}

// ResumeSaga resumes saga id and marks its steps in flight to be sent
// again at their attempt (ResendSteps); resumed is false, and nothing
// changes, when it was not paused.
func ResumeSaga(ctx context.Context, q Querier, id uuid.UUID) (resumed bool, err error) {
	var since time.Time
	err = q.QueryRow(ctx, resumeSaga, pguuid.Of(id)).Scan(&since)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	_, err = q.Exec(ctx, ResendSteps, pguuid.Of(id), since)
	return err == nil, err
}

// ClearDeadline clears the deadline of saga id, once its deadline's cancel
// acted: a saga an operator sets going again afterwards is not cancelled
// again.
func ClearDeadline(ctx context.Context, q Querier, id uuid.UUID) error {
	_, err := q.Exec(ctx, clearDeadline, pguuid.Of(id))
	return err
}
