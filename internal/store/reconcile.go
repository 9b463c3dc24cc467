package store

// Fragments of the reconcile checks' texts.

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
