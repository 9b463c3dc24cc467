package store

// NewestRecorded picks, of a name's recorded versions, the newest one a
// live worker runs, else the newest recorded.
const NewestRecorded = `select d.description from idemsaga.definitions d
where d.name = $1
order by exists (select 1 from idemsaga.workers w
  where d.name || '@' || d.version = any(w.versions) and w.seen_at > idemsaga.now() - $2 * interval '1 millisecond') desc,
  d.version desc
limit 1`
