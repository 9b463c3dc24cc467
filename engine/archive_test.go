package engine_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/maintenance"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// archiveName is the form of an archive file's name: UTC time, host,
// process id, counter.
var archiveName = regexp.MustCompile(`^sagas-\d{8}T\d{6}\.\d{9}Z-[A-Za-z0-9._]+-\d+-\d{6}\.jsonl\.gz$`)

// insertArchivable writes n finished transfer sagas (insertFinishedSagas)
// with a row in every other table that holds a saga's records: a
// repair (by cli:ann for odd keys, http:bob for even ones), a late
// callback, a parked command, a trace context, an unknown inbox outcome.
// The transfer definition is recorded as a worker records it.
func insertArchivable(t *testing.T, pool *pgxpool.Pool, prefix string, n int, ago string) {
	t.Helper()
	insertFinishedSagas(t, pool, prefix, n, ago)
	desc, err := json.Marshal(transferDef(t).Describe())
	require.NoError(t, err)
	execSQL(t, pool, `insert into idemsaga.definitions (name, description, fingerprint, set_by) values ('transfer', $1, 'test', 'test')
on conflict do nothing`, string(desc))
	execSQL(t, pool, `update idemsaga.sagas set trace_context = '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
where idem_key like $1 || '%'`, prefix)
	execSQL(t, pool, `update idemsaga.inbox set unknown = true
where step = 'credit' and saga_id in (select id from idemsaga.sagas where idem_key like $1 || '%')`, prefix)
	execSQL(t, pool, `insert into idemsaga.repairs (saga_id, request_key, operation, request_hash, reason, requested_by, state_after, created_at)
select id, 'r-' || idem_key, 'close', '\x01', 'checked with the bank',
  case when right(idem_key, 1)::int % 2 = 1 then 'cli:ann' else 'http:bob' end, 'credited', finished_at
from idemsaga.sagas where idem_key like $1 || '%'`, prefix)
	execSQL(t, pool, `insert into idemsaga.callbacks (definition, step, event_id, saga_id, body_hash, failed, result, outcome, detail, received_at)
select 'transfer', 'credit', 'ev-' || idem_key, id, '\x02', false, '{"ok": true}', 'late', 'the step was not waiting', finished_at
from idemsaga.sagas where idem_key like $1 || '%'`, prefix)
	execSQL(t, pool, `insert into idemsaga.dead_letters (msg_id, subject, payload, saga_id, definition, definition_version, step, phase, attempt,
  reason, deliveries, parked_by, first_seen)
select 'dl-' || id, 'idemsaga.steps.transfer', '\x00', id, 'transfer', 1, 'credit', 'forward', 1, 'version 1 unknown', 3, 'w1', finished_at
from idemsaga.sagas where idem_key like $1 || '%'`, prefix)
}

// archiveCleaner is a cleaner that archives to dir.
func archiveCleaner(t *testing.T, pool *pgxpool.Pool, dir string, batch int) *maintenance.Cleaner {
	t.Helper()
	return newCleaner(t, pool, engine.RetentionConfig{ArchiveDir: dir, BatchSize: batch})
}

// readArchives reads every archive file in dir, in name order, checking
// that it holds nothing else (no temporary file left behind).
func readArchives(t *testing.T, dir string) (files []string, lines []*saga.ArchivedSaga) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		require.Regexp(t, archiveName, e.Name())
		files = append(files, e.Name())
		f, err := os.Open(filepath.Join(dir, e.Name()))
		require.NoError(t, err)
		for a, err := range saga.ReadArchive(f) {
			require.NoError(t, err, e.Name())
			lines = append(lines, a)
		}
		require.NoError(t, f.Close())
	}
	return files, lines
}

// keyedSagaIDs lists the IDs of the sagas whose key starts with prefix.
func keyedSagaIDs(t *testing.T, pool *pgxpool.Pool, prefix string) []uuid.UUID {
	t.Helper()
	rows, err := pool.Query(context.Background(), `select id from idemsaga.sagas where idem_key like $1 || '%' order by id`, prefix)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	return ids
}

// TestArchiveWritesEverySagaThenDeletes: 20 sagas past the window, in
// batches of 7, go to three archive files and out of the database; each
// line holds what inspection showed of the saga before (steps, attempts,
// callbacks, repairs, dead letters) and the rest of its rows (inbox,
// input hash, trace context), with its definition. Young sagas stay, and
// are in no file.
func TestArchiveWritesEverySagaThenDeletes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertArchivable(t, pool, "old-", 20, "8 days")
	insertArchivable(t, pool, "young-", 3, "1 day")
	cl, err := engine.NewClient(engine.Config{Pool: pool, Logger: quietLogger()})
	require.NoError(t, err)
	live := map[uuid.UUID]string{}
	for _, id := range keyedSagaIDs(t, pool, "old-") {
		sg, err := cl.Get(ctx, id)
		require.NoError(t, err)
		b, err := json.Marshal(sg)
		require.NoError(t, err)
		live[id] = string(b)
	}
	dir := t.TempDir()

	res, err := archiveCleaner(t, pool, dir, 7).CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(20), res.Sagas)
	require.Equal(t, int64(20), res.Archived)
	require.Empty(t, keyedSagaIDs(t, pool, "old-"))
	require.Len(t, keyedSagaIDs(t, pool, "young-"), 3)
	for _, table := range []string{"steps", "inbox", "step_attempts", "repairs", "callbacks", "dead_letters"} {
		require.Equal(t, int64(3), countSQL(t, pool, `select count(distinct saga_id) from idemsaga.`+table), table)
	}

	files, lines := readArchives(t, dir)
	require.Len(t, files, 3, "one file a batch")
	require.True(t, slices.IsSorted(files))
	require.Len(t, lines, 20)
	for _, a := range lines {
		require.Equal(t, saga.ArchiveFormat, a.Format)
		want, ok := live[a.Saga.ID]
		require.True(t, ok, "saga %s (%s) was not due", a.Saga.ID, a.Saga.Key)
		delete(live, a.Saga.ID)
		got, err := json.Marshal(a.Saga)
		require.NoError(t, err)
		require.JSONEq(t, want, string(got), "the archive shows what inspection showed")

		require.Equal(t, saga.State("credited"), a.Saga.State)
		require.Len(t, a.Saga.Steps, 2)
		require.Equal(t, "database", a.Saga.Steps[0].Kind, "kinds from the recorded definition")
		require.Len(t, a.Saga.Attempts, 2, "the timeline: deduct's attempt, credit's retried one")
		require.Equal(t, "retry", a.Saga.Attempts[slices.IndexFunc(a.Saga.Attempts, func(x saga.StepAttempt) bool { return x.Step == "credit" })].Outcome)
		require.Len(t, a.Saga.Repairs, 1)
		author := "http:bob"
		if a.Saga.Key[len(a.Saga.Key)-1]%2 == 1 {
			author = "cli:ann"
		}
		require.Equal(t, author, a.Saga.Repairs[0].By)
		require.Equal(t, "checked with the bank", a.Saga.Repairs[0].Reason)
		require.Len(t, a.Saga.Callbacks, 1)
		require.Equal(t, "ev-"+a.Saga.Key, a.Saga.Callbacks[0].EventID)
		require.Equal(t, "late", a.Saga.Callbacks[0].Outcome)
		require.JSONEq(t, `{"ok": true}`, string(a.Saga.Callbacks[0].Result))
		require.Len(t, a.Saga.DeadLetters, 1)
		require.Equal(t, "version 1 unknown", a.Saga.DeadLetters[0].Reason)
		require.Len(t, a.Inbox, 2)
		for _, in := range a.Inbox {
			require.Equal(t, in.Step == "credit", in.Unknown, in.Step)
			require.Equal(t, "succeeded", in.Outcome)
		}
		require.Equal(t, []byte{0}, a.InputHash)
		require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", a.TraceContext["traceparent"])
		require.NotNil(t, a.Description)
		require.Equal(t, "transfer", a.Description.Name)
		require.WithinDuration(t, time.Now(), a.ArchivedAt, time.Minute)
	}
	require.Empty(t, live, "every saga deleted is archived")

	again, err := archiveCleaner(t, pool, dir, 7).CleanOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, again.Sagas)
	files2, _ := readArchives(t, dir)
	require.Equal(t, files, files2, "a pass with nothing to delete writes no file")
}

// TestArchiveUnwritableDirDeletesNothing: a directory that is missing,
// a file, or (for a user other than root) read-only makes the cleaner
// refuse to start and a pass delete no saga, saying what to fix; other
// kinds of records are still cleaned.
func TestArchiveUnwritableDirDeletesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertArchivable(t, pool, "old-", 5, "8 days")
	insertOutbox(t, pool, 4, "2 hours", true)
	base := t.TempDir()
	file := filepath.Join(base, "a-file")
	require.NoError(t, os.WriteFile(file, []byte("x"), 0o600))
	dirs := []string{filepath.Join(base, "missing"), file}
	if os.Geteuid() != 0 {
		ro := filepath.Join(base, "read-only")
		require.NoError(t, os.Mkdir(ro, 0o500))
		dirs = append(dirs, ro)
	}
	counts := func() []string {
		return rowsJSON(t, pool, `select 'sagas' t, count(*) n from idemsaga.sagas union all select 'steps', count(*) from idemsaga.steps
union all select 'inbox', count(*) from idemsaga.inbox union all select 'attempts', count(*) from idemsaga.step_attempts
union all select 'repairs', count(*) from idemsaga.repairs union all select 'callbacks', count(*) from idemsaga.callbacks`)
	}
	before := counts()
	for _, dir := range dirs {
		c := archiveCleaner(t, pool, dir, 0)
		err := c.Start(ctx)
		require.Error(t, err, dir)
		require.ErrorContains(t, err, dir)
		require.ErrorContains(t, err, "--archive-dir")

		res, err := c.CleanOnce(ctx)
		require.Error(t, err, dir)
		require.ErrorContains(t, err, "cannot write an archive in "+`"`+dir+`"`)
		require.ErrorContains(t, err, "nothing was deleted")
		require.Zero(t, res.Sagas)
		require.Zero(t, res.Archived)
		require.Equal(t, before, counts(), "no saga deleted")
	}
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.outbox where published_at < now() - interval '1 hour'`),
		"the outbox rows, which are not archived, were deleted")
	entries, err := os.ReadDir(base)
	require.NoError(t, err)
	for _, e := range entries {
		if e.IsDir() {
			inside, err := os.ReadDir(filepath.Join(base, e.Name()))
			require.NoError(t, err)
			require.Empty(t, inside, "no file left in %s", e.Name())
		}
	}
}

// TestArchiveConcurrentCleaners runs two cleaners, on two pools, twice
// each and all at once, archiving to one directory: every saga is
// deleted once and in exactly one file (no crash here to archive one
// twice), and none is lost.
func TestArchiveConcurrentCleaners(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := testenv.DBWithURL(t)
	pool2, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool2.Close)
	insertArchivable(t, pool, "old-", 200, "8 days")
	ids := keyedSagaIDs(t, pool, "old-")
	dir := t.TempDir()

	cleaners := []*maintenance.Cleaner{archiveCleaner(t, pool, dir, 10), archiveCleaner(t, pool2, dir, 10)}
	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]maintenance.CleanResult, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Go(func() {
			<-start
			results[i], errs[i] = cleaners[i%2].CleanOnce(ctx)
		})
	}
	close(start)
	wg.Wait()
	t.Logf("each cleaner's share: %+v", results)
	var deleted, archived int64
	for i := range results {
		require.NoError(t, errs[i])
		deleted += results[i].Sagas
		archived += results[i].Archived
	}
	require.Equal(t, int64(200), deleted)
	require.Equal(t, int64(200), archived)
	require.Zero(t, countSQL(t, pool, `select count(*) from idemsaga.sagas`))

	files, lines := readArchives(t, dir)
	require.GreaterOrEqual(t, len(files), 20, "one file a batch of at most 10")
	seen := map[uuid.UUID]int{}
	for _, a := range lines {
		seen[a.Saga.ID]++
		require.Len(t, a.Saga.Repairs, 1)
	}
	for _, id := range ids {
		require.Equal(t, 1, seen[id], "saga %s", id)
	}
	require.Len(t, seen, 200)
}

// TestArchiveCrashBeforeCommitArchivesAgain: when the deletion fails
// after the file was written (as a crash before the commit would), the
// sagas stay and the next pass archives them again: they are in two
// files, never in none.
func TestArchiveCrashBeforeCommitArchivesAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	insertArchivable(t, pool, "old-", 4, "8 days")
	ids := keyedSagaIDs(t, pool, "old-")
	execSQL(t, pool, `create function test_fail_delete() returns trigger language plpgsql as $$
begin raise exception 'test: the process died before the commit'; end $$`)
	execSQL(t, pool, `create trigger fail_delete before delete on idemsaga.sagas for each statement execute function test_fail_delete()`)
	dir := t.TempDir()

	_, err := archiveCleaner(t, pool, dir, 0).CleanOnce(ctx)
	require.ErrorContains(t, err, "the process died before the commit")
	require.Len(t, keyedSagaIDs(t, pool, "old-"), 4, "nothing deleted")
	files, lines := readArchives(t, dir)
	require.Len(t, files, 1)
	require.Len(t, lines, 4)

	execSQL(t, pool, `drop trigger fail_delete on idemsaga.sagas`)
	res, err := archiveCleaner(t, pool, dir, 0).CleanOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(4), res.Sagas)
	files, lines = readArchives(t, dir)
	require.Len(t, files, 2)
	seen := map[uuid.UUID]int{}
	for _, a := range lines {
		seen[a.Saga.ID]++
	}
	for _, id := range ids {
		require.Equal(t, 2, seen[id], "saga %s is in both files", id)
	}
}

// TestArchiveDirNeedsDeletion: an archive directory with sagas kept
// forever is refused, naming the fields.
func TestArchiveDirNeedsDeletion(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?sslmode=disable")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = engine.NewCleaner(pool, engine.RetentionConfig{ArchiveDir: t.TempDir(), FinishedSagas: engine.KeepForever}, nil)
	require.ErrorContains(t, err, "RetentionConfig.ArchiveDir")
	require.ErrorContains(t, err, "KeepForever")
}
