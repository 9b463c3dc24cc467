package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// StaleAfterDefault is how overdue a lease, a retry or an unpublished
// outbox row may be before Reconcile reports it.
const StaleAfterDefault = 30 * time.Second

// Difference is one broken engine invariant.
type Difference struct {
	// SagaID is the saga concerned, if any.
	SagaID *uuid.UUID `json:"saga_id,omitempty"`
	// What says what is wrong.
	What string `json:"what"`
}

func (d Difference) String() string {
	if d.SagaID != nil {
		return fmt.Sprintf("saga %s: %s", d.SagaID, d.What)
	}
	return d.What
}

// Reconcile checks the engine's invariants across the database and
// returns every difference found (none when all hold):
//
//   - every running saga has exactly one step in flight, with a live lease
//     or a retry due no more than staleAfter ago (a paused saga's wait is
//     not overdue); a finished saga has none;
//   - a resumed saga's step in flight was sent again within staleAfter,
//     and no running saga that is not paused is past its deadline by more
//     than staleAfter (compensating ones excepted);
//   - a saga's state agrees with its steps: a saga in its final state has
//     every forward step succeeded, a compensated saga every compensation
//     it started succeeded;
//   - the engine and the inbox agree: no step recorded as failed took
//     effect, no step recorded as succeeded is missing from the inbox
//     (each step key's effect is recorded once, by the inbox's primary key);
//   - no saga ended compensated while a possibly-done step (an attempt's
//     outcome at another system was unknown) was not compensated: that
//     step may have taken effect and is still there, unless an operator
//     took it as not done (a cancel of the parked saga, whose repair names
//     it) or as done (a skip) and it has nothing to undo;
//   - the outbox is drained or draining: no row unpublished for longer than
//     staleAfter after it became the relay's (its hand-off passed), none
//     the broker refused;
//   - a saga started with a submit token is the one the token records as
//     having used it (the two are written in one statement);
//   - an operator's repairs hold: a step skipped (Client.Skip) is
//     succeeded and its key fenced in the inbox (a final record, so no
//     late delivery can take effect), and a closed saga (Client.Close)
//     has its close recorded;
//   - every running saga's definition version is recorded by the
//     deployment, so that any process can plan its moves;
//   - no command is parked in the dead-letter table: a running saga's
//     parked command waits for a worker of its definition version (or a
//     person), one of a finished saga for a person to drop it;
//   - sagas in StateFailed or StateParked are listed: they need a person.
//
// What the schema guards itself (steps, attempts and inbox rows without
// their saga, values outside a domain) is not checked again.
//
// defs gives the final state of each definition version; sagas of other
// definitions or versions are checked for everything else. staleAfter <= 0 means
// StaleAfterDefault.
func Reconcile(ctx context.Context, pool *pgxpool.Pool, defs []*saga.Definition, staleAfter time.Duration) ([]Difference, error) {
	if staleAfter <= 0 {
		staleAfter = StaleAfterDefault
	}
	finals := map[string]string{}
	lengths := map[string]int{}
	// Steps an operator may skip on a parked saga that have nothing to
	// undo: "name@version/step".
	var noUndo []string
	for _, d := range defs {
		finals[d.Ref()] = string(d.FinalState())
		lengths[d.Ref()] = d.Len()
		for i := range d.Len() {
			if d.Step(i).Compensate == nil {
				noUndo = append(noUndo, d.Ref()+"/"+d.Step(i).Name)
			}
		}
	}
	var diffs []Difference
	add := func(rows pgx.Rows, format string) error {
		for rows.Next() {
			var id *uuid.UUID
			var detail string
			if err := rows.Scan(&id, &detail); err != nil {
				rows.Close()
				return err
			}
			diffs = append(diffs, Difference{SagaID: id, What: fmt.Sprintf(format, detail)})
		}
		return rows.Err()
	}
	stale := staleAfter.Seconds()
	checks := []struct {
		format string
		sql    string
		args   []any
	}{
		{"running (state %s) with no step in flight: stuck", `select s.id, s.state from idemsaga.sagas s
where s.finished_at is null and not exists (
  select 1 from idemsaga.steps st where st.saga_id = s.id and st.status in ('dispatched', 'retrying', 'waiting'))`, nil},
		{"has several steps in flight: %s", `select s.id, string_agg(st.step || '/' || st.phase, ', ' order by st.step)
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where st.status in ('dispatched', 'retrying', 'waiting')
group by s.id having count(*) > 1`, nil},
		{"finished but a step is still in flight: %s", `select s.id, st.step || '/' || st.phase
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where s.finished_at is not null and st.status in ('dispatched', 'retrying', 'waiting')`, nil},
		{"lease expired and not taken over: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', expired ' || round(extract(epoch from idemsaga.now() - st.lease_until)) || 's ago' || ` + store.NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'dispatched' and st.lease_until < idemsaga.now() - $1 * interval '1 second'
  and st.next_attempt_at is null and ` + store.NotPaused + ``, []any{stale}},
		{"retry overdue: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', due ' || round(extract(epoch from idemsaga.now() - st.next_attempt_at)) || 's ago' || ` + store.NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'retrying' and st.next_attempt_at < idemsaga.now() - $1 * interval '1 second'
  and ` + store.NotPaused + ``, []any{stale}},
		{"resumed, but its step in flight was not sent again: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', resumed ' || round(extract(epoch from idemsaga.now() - st.next_attempt_at)) || 's ago' || ` + store.NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'dispatched' and st.next_attempt_at < idemsaga.now() - $1 * interval '1 second'
  and ` + store.NotPaused + ``, []any{stale}},
		{"past its deadline and not cancelled: %s", `select s.id, 'deadline ' || round(extract(epoch from idemsaga.now() - s.deadline_at)) || 's ago, state ' || s.state || ` + store.NoWorker + `
from idemsaga.sagas s where s.finished_at is null and s.state <> 'compensating' and s.deadline_at < idemsaga.now() - $1 * interval '1 second'
  and ` + store.NotPaused + ``, []any{stale}},
		{"step recorded as failed took effect: %s", `select st.saga_id, st.step || '/' || st.phase
from idemsaga.steps st join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.status = 'failed' and i.outcome = 'succeeded'`, nil},
		{"step recorded as succeeded has no success in the inbox: %s", `select st.saga_id, st.step || '/' || st.phase
from idemsaga.steps st left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.status = 'succeeded' and (i.outcome is distinct from 'succeeded')
  and not exists (select 1 from idemsaga.repairs r where r.saga_id = st.saga_id and r.operation = 'skip' and r.step = st.step and r.phase = st.phase)`, nil},
		{"step skipped by an operator is not fenced: %s", `select r.saga_id, r.step || '/' || r.phase || ' is ' || coalesce(st.status, 'missing') || ', its key holds ' || coalesce(i.outcome, 'nothing')
from idemsaga.repairs r
left join idemsaga.steps st on st.saga_id = r.saga_id and st.step = r.step and st.phase = r.phase
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where r.operation = 'skip' and (st.status is distinct from 'succeeded' or i.outcome is null or i.outcome in ('started', 'retry', 'waiting'))`, nil},
		{"closed with no close recorded in its repairs%s", `select s.id, '' from idemsaga.sagas s
where s.state = 'closed' and not exists (select 1 from idemsaga.repairs r where r.saga_id = s.id and r.operation = 'close')`, nil},
		{"compensated, but a compensation did not succeed: %s", `select s.id, st.step || ' ' || st.status
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where s.state = 'compensated' and st.phase = 'compensate' and st.status <> 'succeeded'`, nil},
		{"compensated, but a step that may have taken effect was not compensated: %s", `select s.id, st.step || ' (key ' || st.key || ', ' || st.status || ', ' ||
  case when c.status is null then 'no compensation ran' else 'its compensation is ' || c.status end || ')'
from idemsaga.sagas s
join idemsaga.steps st on st.saga_id = s.id and st.phase = 'forward'
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
left join idemsaga.steps c on c.saga_id = st.saga_id and c.step = st.step and c.phase = 'compensate'
where s.state = 'compensated'
  and (st.possibly_done or coalesce(i.unknown, false) or i.outcome = 'started')
  and c.status is distinct from 'succeeded'
  and not exists (select 1 from idemsaga.repairs r where r.saga_id = s.id and r.step = st.step and r.phase = 'forward' and (r.operation = 'cancel'
    or r.operation = 'skip' and s.definition || '@' || s.definition_version || '/' || st.step = any($1)))`, []any{noUndo}},
		{"waits for its callback past its deadline and was not given up: %s", `select st.saga_id, st.step || ' attempt ' || st.attempt || ', deadline ' || round(extract(epoch from idemsaga.now() - st.lease_until)) || 's ago' || ` + store.NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'waiting' and st.lease_until < idemsaga.now() - $1 * interval '1 second' and ` + store.NotPaused, []any{stale}},
		{"a callback is pending for a step that waits (it should have completed it): %s", `select cb.saga_id, cb.step || ' event ' || cb.event_id
from idemsaga.callbacks cb join idemsaga.steps st on st.saga_id = cb.saga_id and st.step = cb.step and st.phase = 'forward'
where cb.outcome = 'pending' and st.status = 'waiting'`, nil},
		{"a callback completed a step that did not end as it said: %s", `select cb.saga_id, cb.step || ' event ' || cb.event_id || ': step ' || coalesce(st.status, 'missing')
from idemsaga.callbacks cb left join idemsaga.steps st on st.saga_id = cb.saga_id and st.step = cb.step and st.phase = 'forward'
where cb.outcome = 'applied' and st.status is distinct from (case when cb.failed then 'failed' else 'succeeded' end)`, nil},
		{"several callbacks completed one step: %s", `select saga_id, step || ': ' || string_agg(event_id, ', ' order by event_id)
from idemsaga.callbacks where outcome = 'applied' group by saga_id, step having count(*) > 1`, nil},
		{"running on a definition version the deployment has not recorded: %s (no process can plan its moves; start a worker with that version's code)", `select s.id, s.definition || '@' || s.definition_version
from idemsaga.sagas s where s.finished_at is null and not exists (
  select 1 from idemsaga.definitions d where d.name = s.definition and d.version = s.definition_version)`, nil},
		{"running with a command parked: %s", `select d.saga_id, ` + store.DeadLetterDetail + `
from idemsaga.dead_letters d join idemsaga.sagas s on s.id = d.saga_id where s.finished_at is null order by d.id`, nil},
		{"finished, but a command of it is still parked: %s; drop it with `dead-letters drop`", `select d.saga_id, ` + store.DeadLetterDetail + `
from idemsaga.dead_letters d join idemsaga.sagas s on s.id = d.saga_id where s.finished_at is not null order by d.id`, nil},
		{"failed and needs a person: %s", `select s.id, coalesce(s.error, 'no error recorded') from idemsaga.sagas s where s.state = 'failed'`, nil},
		{"parked and needs a person: %s", `select s.id, coalesce(s.error, 'no error recorded') from idemsaga.sagas s where s.state = 'parked'`, nil},
		{"started with submit token %s", `select s.id, t.token || ', which is recorded as ' ||
  case when t.saga_id is null then 'unused' else 'used by saga ' || t.saga_id end
from idemsaga.submit_tokens t join idemsaga.sagas s on s.definition = t.definition and s.idem_key = t.token
where t.saga_id is distinct from s.id`, nil},
		{"%s", `select null::uuid, 'outbox row ' || id || ' (' || subject || ') unpublished for ' || round(extract(epoch from idemsaga.now() - created_at)) || 's'
  || coalesce(', ' || attempts || ' failed publishes, last: ' || last_error, '')
from idemsaga.outbox where published_at is null and (attempts > 0
  or publish_after < statement_timestamp() - $1 * interval '1 second'
  or publish_after is null and created_at < idemsaga.now() - $1 * interval '1 second')
order by id limit 100`, []any{stale}},
	}
	for _, c := range checks {
		rows, err := pool.Query(ctx, c.sql, c.args...)
		if err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
		if err := add(rows, c.format); err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
	}

	// Sagas in their final state: every forward step succeeded.
	rows, err := pool.Query(ctx, `select s.id, s.definition || '@' || s.definition_version, s.state, count(st.step) filter (where st.phase = 'forward' and st.status = 'succeeded')
from idemsaga.sagas s left join idemsaga.steps st on st.saga_id = s.id
where s.finished_at is not null and s.state not in ('compensated', 'failed', 'parked', 'closed')
group by s.id, s.definition, s.definition_version, s.state`)
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id uuid.UUID
		var def, state string
		var succeeded int
		if err := rows.Scan(&id, &def, &state, &succeeded); err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
		final, known := finals[def]
		switch {
		case !known:
			continue
		case state != final:
			diffs = append(diffs, Difference{SagaID: &id, What: fmt.Sprintf("finished in state %q, which is not terminal for %q", state, def)})
		case succeeded != lengths[def]:
			diffs = append(diffs, Difference{SagaID: &id, What: fmt.Sprintf("in final state %q with %d of %d forward steps succeeded", state, succeeded, lengths[def])})
		}
	}
	if err := rows.Err(); err != nil && !errors.Is(err, context.Canceled) {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	return diffs, nil
}
