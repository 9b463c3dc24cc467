package store

// The statements of child sagas (saga.ChildStep): the start fenced by
// the parent's attempt, the link from child to parent, and the reads of
// a child's end.

// FenceChildStart holds the parent step's key ($2 of saga $1) while its
// child starts, in the start's transaction: a row when attempt $3 still
// leads it (claimed, not given up), none otherwise. FOR SHARE: a
// tombstone (a give-up, a compensation's fence) waits for the start to
// commit, and after it no attempt starts a child.
const FenceChildStart = `select true from idemsaga.inbox
where saga_id = $1 and step_key = $2 and attempt = $3 and outcome = 'started'
for share`

// SetParent links the child $1 just started to its parent $2 and the
// parent's step $3.
const SetParent = `update idemsaga.sagas set parent_id = $2, parent_step = $3 where id = $1 and parent_id is null`

// ChildColumns are what a parent reads of its child: its id, state,
// whether it finished, its error and results.
const ChildColumns = `id, state::text, finished_at is not null, coalesce(error, ''), results`

// SelectChildByKey reads the child of definition $1 under key $2
// (saga.ChildKey).
const SelectChildByKey = `select ` + ChildColumns + ` from idemsaga.sagas where definition = $1 and idem_key = $2`

// SelectParentOf reads the parent and parent step of saga $1; no row for
// a saga that is nobody's child.
const SelectParentOf = `select parent_id, parent_step from idemsaga.sagas where id = $1 and parent_id is not null`

// SelectChildEnds finds up to $1 children whose end their parent's step
// still waits for: the end was applied by nobody (the process that moved
// the child stopped before it told the parent). Only parents of the
// definition versions in $2 (those this process runs) are looked at.
const SelectChildEnds = `select c.id from idemsaga.sagas c
join idemsaga.steps s on s.saga_id = c.parent_id and s.step = c.parent_step and s.status = 'waiting'
join idemsaga.sagas p on p.id = c.parent_id and p.definition || '@' || p.definition_version = any($2)
where c.parent_id is not null and c.finished_at is not null and c.state <> 'parked'
  and (s.phase = 'forward' or c.state in ('compensated', 'failed', 'closed'))
order by c.finished_at
limit $1`

// SelectChildren lists the children of saga $1, for inspection.
const SelectChildren = `select parent_step, id, definition, state::text from idemsaga.sagas
where parent_id = $1 order by created_at, id`

// CompleteChildNotDone records under a child step's waiting key ($2, at
// attempt $3 or before) that the step failed ($4 says why) and took no
// effect: its child compensated itself. The key's doubt (an attempt
// whose answer was lost) is resolved, as a Verify's "not done" resolves
// it. The saga's lock rules out a miss.
const CompleteChildNotDone = `with c as (
  update idemsaga.inbox set outcome = 'failed', result = null, error = $4::text, unknown = false, verified = true
  where saga_id = $1 and step_key = $2 and attempt <= $3 and outcome = 'waiting'
  returning 1
)
select case when not exists (select from c) then idemsaga.invariant_broken('a waiting step''s key was not waiting at its attempt') end`
