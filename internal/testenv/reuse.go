package testenv

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// Databases a test used are kept for the next test of the process when
// they can be brought back to the template's state surely: their
// catalogue (schemas, tables, columns, functions, triggers, constraints,
// settings) is the template's, the tables the template holds rows in hold
// the same rows, and every other table is emptied with its sequences
// restarted. Anything else (a test that dropped a schema, replaced a
// function or added a table) drops the database, as before. So a package's
// tests create about as many databases as run at once, not one each.
var reuse struct {
	mu   sync.Mutex
	free []string
	// created and reused count DB's databases, for Main's summary.
	created, reused atomic.Int64
	// shape is the template's catalogue digest; kept its tables that
	// hold rows, with their contents' digests; empty the others; seqs its
	// sequences' states.
	shape string
	kept  map[string]string
	empty []string
	seqs  string
}

// shapeSQL digests the catalogue of the current database: what a test
// could change besides rows.
const shapeSQL = `with n as (
  select oid, nspname from pg_namespace where nspname not in ('pg_catalog', 'information_schema') and nspname !~ '^pg_(toast|temp)'
)
select md5(coalesce(string_agg(x, E'\n' order by x), '')) from (
  select 'schema ' || nspname as x from n
  union all
  select format('rel %s.%s %s %s', n.nspname, c.relname, c.relkind, c.relnatts) from pg_class c join n on n.oid = c.relnamespace
  union all
  select format('col %s %s %s %s %s', a.attrelid::regclass, a.attname, a.atttypid, a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
    from pg_attribute a join pg_class c on c.oid = a.attrelid join n on n.oid = c.relnamespace
    left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
    where a.attnum > 0 and not a.attisdropped
  union all
  select 'fn ' || pg_get_functiondef(p.oid) from pg_proc p join n on n.oid = p.pronamespace where p.prokind in ('f', 'p')
  union all
  select format('trg %s %s %s', t.tgrelid::regclass, t.tgname, t.tgenabled) from pg_trigger t where not t.tgisinternal
  union all
  select format('con %s %s %s', c.conrelid::regclass, c.conname, pg_get_constraintdef(c.oid)) from pg_constraint c join n on n.oid = c.connamespace
  union all
  select format('set %s', s.setconfig) from pg_db_role_setting s where s.setdatabase = (select oid from pg_database where datname = current_database())
  union all
  select format('prepared %s', gid) from pg_prepared_xacts where database = current_database()
) f`

// tablesSQL lists the current database's ordinary tables, qualified.
const tablesSQL = `select format('%I.%I', n.nspname, c.relname) from pg_class c join pg_namespace n on n.oid = c.relnamespace
where c.relkind in ('r', 'p') and n.nspname not in ('pg_catalog', 'information_schema') and n.nspname !~ '^pg_(toast|temp)'
order by 1`

// seqsSQL digests the states of the current database's sequences.
const seqsSQL = `select md5(coalesce(string_agg(format('%s %s %s', schemaname, sequencename, last_value), E'\n' order by schemaname, sequencename), ''))
from pg_sequences`

func digest(ctx context.Context, conn *pgx.Conn, table string) (string, error) {
	var d string
	err := conn.QueryRow(ctx, `select md5(coalesce(string_agg(t::text, E'\n' order by t::text), '')) from `+table+` t`).Scan(&d)
	return d, err
}

// learnTemplate records what a database must match to be reused.
func learnTemplate(ctx context.Context, conn *pgx.Conn) error {
	if err := conn.QueryRow(ctx, shapeSQL).Scan(&reuse.shape); err != nil {
		return fmt.Errorf("read the template's catalogue: %w", err)
	}
	rows, err := conn.Query(ctx, tablesSQL)
	if err != nil {
		return fmt.Errorf("list the template's tables: %w", err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("list the template's tables: %w", err)
	}
	reuse.kept = map[string]string{}
	for _, t := range tables {
		var has bool
		if err := conn.QueryRow(ctx, `select exists (select from `+t+`)`).Scan(&has); err != nil {
			return fmt.Errorf("read template table %s: %w", t, err)
		}
		if !has {
			reuse.empty = append(reuse.empty, t)
			continue
		}
		if reuse.kept[t], err = digest(ctx, conn, t); err != nil {
			return fmt.Errorf("read template table %s: %w", t, err)
		}
	}
	if err := conn.QueryRow(ctx, seqsSQL).Scan(&reuse.seqs); err != nil {
		return fmt.Errorf("read the template's sequences: %w", err)
	}
	return nil
}

// takeFree returns a database kept for reuse, if there is one.
func takeFree() (string, bool) {
	reuse.mu.Lock()
	defer reuse.mu.Unlock()
	if n := len(reuse.free); n > 0 {
		name := reuse.free[n-1]
		reuse.free = reuse.free[:n-1]
		reuse.reused.Add(1)
		return name, true
	}
	reuse.created.Add(1)
	return "", false
}

// release brings database name back to the template's state and keeps it
// for the next test, or drops it when it cannot. The test's pool is
// closed; connections left by its processes are ended first.
func release(ctx context.Context, admin *pgx.Conn, name string) error {
	if _, err := admin.Exec(ctx, `select pg_terminate_backend(pid) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()`, name); err != nil {
		return drop(ctx, admin, name)
	}
	if reset(ctx, name) != nil {
		return drop(ctx, admin, name)
	}
	reuse.mu.Lock()
	reuse.free = append(reuse.free, name)
	reuse.mu.Unlock()
	return nil
}

// reset empties what the template has empty in database name, after
// checking that nothing else differs from the template.
func reset(ctx context.Context, name string) error {
	url, err := withDatabase(AdminURL(), name)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var shape string
	if err := conn.QueryRow(ctx, shapeSQL).Scan(&shape); err != nil {
		return err
	}
	if shape != reuse.shape {
		return fmt.Errorf("database %s: its catalogue differs from the template's", name)
	}
	for t, want := range reuse.kept {
		if got, err := digest(ctx, conn, t); err != nil || got != want {
			return fmt.Errorf("database %s: table %s differs from the template's", name, t)
		}
	}
	if len(reuse.empty) > 0 {
		if _, err := conn.Exec(ctx, `truncate `+strings.Join(reuse.empty, ", ")+` restart identity`); err != nil {
			return err
		}
	}
	var seqs string
	if err := conn.QueryRow(ctx, seqsSQL).Scan(&seqs); err != nil || seqs != reuse.seqs {
		return fmt.Errorf("database %s: its sequences differ from the template's", name)
	}
	return nil
}

func drop(ctx context.Context, admin *pgx.Conn, name string) error {
	_, err := admin.Exec(ctx, "drop database if exists "+name+" with (force)")
	return err
}

// dropFree drops the databases kept for reuse, and says how many
// databases the process's tests created.
func dropFree(ctx context.Context, admin *pgx.Conn) {
	reuse.mu.Lock()
	free := reuse.free
	reuse.free = nil
	reuse.mu.Unlock()
	for _, name := range free {
		_ = drop(ctx, admin, name)
	}
	if c, r := reuse.created.Load(), reuse.reused.Load(); c+r > 0 && os.Getenv("IDEMSAGA_TESTENV_QUIET") == "" {
		fmt.Fprintf(os.Stderr, "testenv: %d test databases: %d created, %d reused\n", c+r, c, r)
	}
}
