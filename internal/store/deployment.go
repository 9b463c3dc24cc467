package store

// RecordSetting records a deployment's shared setting, replacing another
// value (migrate).
const RecordSetting = `insert into idemsaga.settings (name, value, set_by) values ($1, $2, $3)
on conflict (name) do update set value = excluded.value, set_by = excluded.set_by, set_at = idemsaga.now()
where settings.value is distinct from excluded.value`

// RecordDefinition records a definition's description at its version,
// replacing another (migrate).
const RecordDefinition = `insert into idemsaga.definitions (name, version, description, fingerprint, set_by) values ($1, $5, $2, $3, $4)
on conflict (name, version) do update set description = excluded.description, fingerprint = excluded.fingerprint, set_by = excluded.set_by, set_at = idemsaga.now()
where definitions.fingerprint is distinct from excluded.fingerprint`

// CheckSetting records a shared setting the deployment lacks, and returns
// the deployment's value, who set it and when.
const CheckSetting = `with i as (
  insert into idemsaga.settings (name, value, set_by) values ($1, $2, $3) on conflict (name) do nothing returning value, set_by, set_at)
select value, set_by, set_at from i
union all select value, set_by, set_at from idemsaga.settings where name = $1 and not exists (select from i)`

// CheckDefinition records a definition the deployment lacks at its version,
// and returns the deployment's fingerprint, description, who set it and
// when.
const CheckDefinition = `with i as (
  insert into idemsaga.definitions (name, version, description, fingerprint, set_by) values ($1, $5, $2, $3, $4)
  on conflict (name, version) do nothing returning fingerprint, description, set_by, set_at)
select fingerprint, description, set_by, set_at from i
union all select fingerprint, description, set_by, set_at from idemsaga.definitions where name = $1 and version = $5 and not exists (select from i)`

// Heartbeat records that a worker ($1) runs, with what it runs.
const Heartbeat = `insert into idemsaga.workers (id, host, pid, definitions, versions) values ($1, $2, $3, $4, $5)
on conflict (id) do update set seen_at = idemsaga.now()`

// DeleteDeadWorkers deletes the rows of processes that died without
// deleting theirs.
const DeleteDeadWorkers = `delete from idemsaga.workers where seen_at < idemsaga.now() - interval '1 hour'`

// DeleteWorker deletes a stopping worker's row.
const DeleteWorker = `delete from idemsaga.workers where id = $1`
