package store

// Rule is one of the writer's invariants as reconcile checks it from
// outside: a query that returns (saga id, detail) for each place where it
// does not hold. A repair must never produce a state a rule reports,
// except the two that list sagas for a person (failed, parked).
type Rule struct {
	// Difference is how a breach reads, with %s for its detail.
	Difference string
	SQL        string
	// Takes is the query's parameter, if any.
	Takes RuleParam
	// Check names the rule, for Difference.Check and the metric.
	Check string
}

// RuleParam is what a rule's query takes as $1.
type RuleParam int

const (
	// NoParam: the query takes nothing.
	NoParam RuleParam = iota
	// StaleSeconds: how overdue a lease, a retry or an outbox row may be,
	// in seconds.
	StaleSeconds
	// StepsWithoutUndo: the steps ("name@version/step") that have no
	// compensation, which an operator's skip may leave undone.
	StepsWithoutUndo
	// BranchGroups: a JSON object naming each branch of a parallel group
	// ("name@version/step") with its group.
	BranchGroups
	// BranchStates: a JSON object naming each branch of a parallel group
	// ("name@version/step") with its group's state.
	BranchStates
)

// Rules are the writer's invariants, stated once.
var Rules = []Rule{
	{"running (state %s) with no step in flight: stuck", `select s.id, s.state from idemsaga.sagas s
where s.finished_at is null and not exists (
  select 1 from idemsaga.steps st where st.saga_id = s.id and st.status in ('dispatched', 'retrying', 'waiting'))`, NoParam, "stuck"},
	{"has several steps in flight: %s", `select s.id, string_agg(st.step || '/' || st.phase, ', ' order by st.step)
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where st.status in ('dispatched', 'retrying', 'waiting')
group by s.id having count(distinct coalesce('group ' || ($1::jsonb ->> (s.definition || '@' || s.definition_version || '/' || st.step)), st.step) || '/' || st.phase) > 1`, BranchGroups, "several_in_flight"},
	{"is in its group's state while a branch of the group has not succeeded: %s", `select s.id, st.step || ' is ' || st.status || ' (state ' || s.state || ')'
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id and st.phase = 'forward'
where st.status <> 'succeeded' and s.state = ($1::jsonb ->> (s.definition || '@' || s.definition_version || '/' || st.step))`, BranchStates, "group_state_early"},
	{"finished but a step is still in flight: %s", `select s.id, st.step || '/' || st.phase
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where s.finished_at is not null and st.status in ('dispatched', 'retrying', 'waiting')`, NoParam, "finished_in_flight"},
	{"lease expired and not taken over: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', expired ' || round(extract(epoch from idemsaga.now() - st.lease_until)) || 's ago' || ` + NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'dispatched' and st.lease_until < idemsaga.now() - $1 * interval '1 second'
  and st.next_attempt_at is null and ` + NotPaused + ``, StaleSeconds, "lease_not_taken_over"},
	{"retry overdue: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', due ' || round(extract(epoch from idemsaga.now() - st.next_attempt_at)) || 's ago' || ` + NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'retrying' and st.next_attempt_at < idemsaga.now() - $1 * interval '1 second'
  and ` + NotPaused + ``, StaleSeconds, "retry_overdue"},
	{"resumed, but its step in flight was not sent again: %s", `select st.saga_id, st.step || '/' || st.phase || ' attempt ' || st.attempt || ', resumed ' || round(extract(epoch from idemsaga.now() - st.next_attempt_at)) || 's ago' || ` + NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'dispatched' and st.next_attempt_at < idemsaga.now() - $1 * interval '1 second'
  and ` + NotPaused + ``, StaleSeconds, "resume_not_sent"},
	{"past its deadline and not cancelled: %s", `select s.id, 'deadline ' || round(extract(epoch from idemsaga.now() - s.deadline_at)) || 's ago, state ' || s.state || ` + NoWorker + `
from idemsaga.sagas s where s.finished_at is null and s.state <> 'compensating' and s.deadline_at < idemsaga.now() - $1 * interval '1 second'
  and ` + NotPaused + ``, StaleSeconds, "deadline_not_cancelled"},
	{"step skipped by its condition has a step row: %s", `select s.id, st.step || '/' || st.phase || ' ' || st.status
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id and st.step = any(s.skipped)`, NoParam, "skipped_has_row"},
	{"step recorded as failed took effect: %s", `select st.saga_id, st.step || '/' || st.phase
from idemsaga.steps st join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.status = 'failed' and i.outcome = 'succeeded'`, NoParam, "failed_took_effect"},
	{"step recorded as succeeded has no success in the inbox: %s", `select st.saga_id, st.step || '/' || st.phase
from idemsaga.steps st left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where st.status = 'succeeded' and (i.outcome is distinct from 'succeeded')
  and not exists (select 1 from idemsaga.repairs r where r.saga_id = st.saga_id and r.operation = 'skip' and r.step = st.step and r.phase = st.phase)`, NoParam, "succeeded_not_in_inbox"},
	{"step skipped by an operator is not fenced: %s", `select r.saga_id, r.step || '/' || r.phase || ' is ' || coalesce(st.status, 'missing') || ', its key holds ' || coalesce(i.outcome, 'nothing')
from idemsaga.repairs r
left join idemsaga.steps st on st.saga_id = r.saga_id and st.step = r.step and st.phase = r.phase
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
where r.operation = 'skip' and (st.status is distinct from 'succeeded' or i.outcome is null or i.outcome in ('started', 'retry', 'waiting'))`, NoParam, "skip_not_fenced"},
	{"closed with no close recorded in its repairs%s", `select s.id, '' from idemsaga.sagas s
where s.state = 'closed' and not exists (select 1 from idemsaga.repairs r where r.saga_id = s.id and r.operation = 'close')`, NoParam, "close_not_recorded"},
	{"compensated, but a compensation did not succeed: %s", `select s.id, st.step || ' ' || st.status
from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
where s.state = 'compensated' and st.phase = 'compensate' and st.status <> 'succeeded'`, NoParam, "compensation_failed"},
	{"compensated, but a step that may have taken effect was not compensated: %s", `select s.id, st.step || ' (key ' || st.key || ', ' || st.status || ', ' ||
  case when c.status is null then 'no compensation ran' else 'its compensation is ' || c.status end || ')'
from idemsaga.sagas s
join idemsaga.steps st on st.saga_id = s.id and st.phase = 'forward'
left join idemsaga.inbox i on i.saga_id = st.saga_id and i.step_key = st.key
left join idemsaga.steps c on c.saga_id = st.saga_id and c.step = st.step and c.phase = 'compensate'
where s.state = 'compensated'
  and (` + Doubt + ` or i.outcome = 'started')
  and c.status is distinct from 'succeeded'
  and not exists (select 1 from idemsaga.repairs r where r.saga_id = s.id and r.step = st.step and r.phase = 'forward' and (r.operation = 'cancel'
    or r.operation = 'skip' and s.definition || '@' || s.definition_version || '/' || st.step = any($1)))`, StepsWithoutUndo, "possibly_done_not_compensated"},
	{"compensated, but a child of it was not: %s", `select s.id, 'child ' || c.id || ' (step ' || c.parent_step || ') is ' || c.state
from idemsaga.sagas s join idemsaga.sagas c on c.parent_id = s.id
where s.state = 'compensated' and c.state not in ('compensated', 'closed')
  and not exists (select 1 from idemsaga.repairs r where r.saga_id = s.id and r.step = c.parent_step and r.operation = 'skip')`, NoParam, "child_not_compensated"},
	{"a child step started several children: %s", `select parent_id, parent_step || ': ' || string_agg(id::text, ', ' order by id)
from idemsaga.sagas where parent_id is not null group by parent_id, parent_step having count(*) > 1`, NoParam, "several_children"},
	{"waits for a child that ended and was not told: %s", `select s.saga_id, s.step || '/' || s.phase || ' waits for child ' || c.id || ', ' || c.state || ' ' || round(extract(epoch from idemsaga.now() - c.finished_at)) || 's ago'
from idemsaga.sagas c
join idemsaga.steps s on s.saga_id = c.parent_id and s.step = c.parent_step and s.status = 'waiting'
where c.parent_id is not null and c.finished_at < idemsaga.now() - $1 * interval '1 second' and c.state <> 'parked'
  and (s.phase = 'forward' or c.state in ('compensated', 'failed', 'closed'))`, StaleSeconds, "child_end_not_applied"},
	{"several sagas started for one tick of its schedule: %s", `select min(id::text)::uuid, definition || ' ' || string_agg(idem_key, ', ' order by idem_key)
from idemsaga.sagas where idem_key ~ '^tick:[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(Z|[+-][0-9]{2}:[0-9]{2})$'
group by definition, substr(idem_key, 6)::timestamptz having count(*) > 1`, NoParam, "several_per_tick"},
	{"waits for its callback past its deadline and was not given up: %s", `select st.saga_id, st.step || ' attempt ' || st.attempt || ', deadline ' || round(extract(epoch from idemsaga.now() - st.lease_until)) || 's ago' || ` + NoWorker + `
from idemsaga.steps st join idemsaga.sagas s on s.id = st.saga_id where st.status = 'waiting' and st.lease_until < idemsaga.now() - $1 * interval '1 second' and ` + NotPaused, StaleSeconds, "callback_wait_overdue"},
	{"a callback is pending for a step that waits (it should have completed it): %s", `select cb.saga_id, cb.step || ' event ' || cb.event_id
from idemsaga.callbacks cb join idemsaga.steps st on st.saga_id = cb.saga_id and st.step = cb.step and st.phase = 'forward'
where cb.outcome = 'pending' and st.status = 'waiting'`, NoParam, "callback_pending"},
	{"a callback completed a step that did not end as it said: %s", `select cb.saga_id, cb.step || ' event ' || cb.event_id || ': step ' || coalesce(st.status, 'missing')
from idemsaga.callbacks cb left join idemsaga.steps st on st.saga_id = cb.saga_id and st.step = cb.step and st.phase = 'forward'
where cb.outcome = 'applied' and st.status is distinct from (case when cb.failed then 'failed' else 'succeeded' end)`, NoParam, "callback_mismatch"},
	{"several callbacks completed one step: %s", `select saga_id, step || ': ' || string_agg(event_id, ', ' order by event_id)
from idemsaga.callbacks where outcome = 'applied' group by saga_id, step having count(*) > 1`, NoParam, "callbacks_several"},
	{"running on a definition version the deployment has not recorded: %s (no process can plan its moves; start a worker with that version's code)", `select s.id, s.definition || '@' || s.definition_version
from idemsaga.sagas s where s.finished_at is null and not exists (
  select 1 from idemsaga.definitions d where d.name = s.definition and d.version = s.definition_version)`, NoParam, "version_not_recorded"},
	{"running with a command parked: %s", `select d.saga_id, ` + DeadLetterDetail + `
from idemsaga.dead_letters d join idemsaga.sagas s on s.id = d.saga_id where s.finished_at is null order by d.id`, NoParam, "command_parked"},
	{"finished, but a command of it is still parked: %s; drop it with `dead-letters drop`", `select d.saga_id, ` + DeadLetterDetail + `
from idemsaga.dead_letters d join idemsaga.sagas s on s.id = d.saga_id where s.finished_at is not null order by d.id`, NoParam, "finished_command_parked"},
	{"failed and needs a person: %s", `select s.id, coalesce(s.error, 'no error recorded') from idemsaga.sagas s where s.state = 'failed'`, NoParam, "failed"},
	{"parked and needs a person: %s", `select s.id, coalesce(s.error, 'no error recorded') from idemsaga.sagas s where s.state = 'parked'`, NoParam, "parked"},
	{"started with submit token %s", `select s.id, t.token || ', which is recorded as ' ||
  case when t.saga_id is null then 'unused' else 'used by saga ' || t.saga_id end
from idemsaga.submit_tokens t join idemsaga.sagas s on s.definition = t.definition and s.idem_key = t.token
where t.saga_id is distinct from s.id`, NoParam, "submit_token"},
	{"%s", `select null::uuid, 'outbox row ' || id || ' (' || subject || ') unpublished for ' || round(extract(epoch from idemsaga.now() - created_at)) || 's'
  || coalesce(', ' || attempts || ' failed publishes, last: ' || last_error, '')
from idemsaga.outbox where published_at is null and (attempts > 0
  or publish_after < statement_timestamp() - $1 * interval '1 second'
  or publish_after is null and created_at < idemsaga.now() - $1 * interval '1 second')
order by id limit 100`, StaleSeconds, "outbox_stale"},
}

// FinishedForwardSteps reads each saga that finished in a state other
// than compensated, failed, parked or closed, with how many of its forward
// steps succeeded or were skipped: one in its definition's final state
// has them all.
const FinishedForwardSteps = `select s.id, s.definition || '@' || s.definition_version, s.state,
  count(st.step) filter (where st.phase = 'forward' and st.status = 'succeeded') + cardinality(s.skipped)
from idemsaga.sagas s left join idemsaga.steps st on st.saga_id = s.id
where s.finished_at is not null and s.state not in ('compensated', 'failed', 'parked', 'closed')
group by s.id, s.definition, s.definition_version, s.state, s.skipped`

// Fragments of the rules' texts.

// NoWorker says, in a difference about a saga s, when no live worker
// runs its definition: the likely reason nothing takes its step over.
const NoWorker = `case when not exists (select 1 from idemsaga.workers w
  where s.definition || '@' || s.definition_version = any(w.versions) and w.seen_at > idemsaga.now() - interval '15 seconds')
  then '; no live worker runs definition ' || s.definition || ' version ' || s.definition_version || ' (start one with its code)' else '' end`

// DeadLetterDetail describes a dead letter d: what it is, why it was
// parked, and whether a live worker runs its version (which sends it
// again at its next heartbeat).
const DeadLetterDetail = `'dead letter ' || d.id || ' (' || d.step || '/' || d.phase || ' attempt ' || d.attempt || ' of ' || d.definition || '@' || d.definition_version || ', '
  || d.deliveries || ' deliveries, last ' || round(extract(epoch from idemsaga.now() - d.last_seen)) || 's ago): ' || d.reason ||
  case when exists (select 1 from idemsaga.workers w
    where d.definition || '@' || d.definition_version = any(w.versions) and w.seen_at > idemsaga.now() - interval '15 seconds')
  then '; a live worker runs its version and sends it again at its next heartbeat'
  else '; no live worker runs ' || d.definition || ' version ' || d.definition_version || ': start one with its code, or resend or drop it with ` + "`dead-letters`" + `' end`
