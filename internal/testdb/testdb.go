// Package testdb keeps the PostgreSQL databases of a test process: a
// migrated template per set of migrations, test databases cloned from it,
// and databases a test used, brought back to the template's state for the
// next test instead of dropped. Packages testenv and sagatest take their
// databases here.
//
// A database is reused only when that is sure: its catalogue (schemas,
// tables, columns, functions, triggers, constraints, settings) is its
// template's, and once every table is emptied (sequences restarted) and
// the rows the template holds are put back, its sequences are the
// template's. Anything else (a dropped schema, a replaced function, a
// table a test added) drops it. Reuse needs the process to drop what it
// kept when its tests end: Manage says it will (Cleanup, from TestMain).
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// Template is a migrated database and the test databases kept from it.
type Template struct {
	admin, name, prefix string
	// shape is the template's catalogue digest; kept its tables that
	// hold rows, with those rows as JSON; all every table; seqs the digest
	// of its sequences' states.
	shape string
	kept  map[string]string
	all   []string
	seqs  string

	mu              sync.Mutex
	free            []string
	created, reused atomic.Int64
}

var (
	mu        sync.Mutex
	templates = map[string]*Template{}
	building  = map[string]*sync.Mutex{}
	managed   atomic.Bool
)

// Manage says the process calls Cleanup once its tests ended, so that
// databases may be kept between tests.
func Manage() { managed.Store(true) }

// Managed reports Manage.
func Managed() bool { return managed.Load() }

// Name returns a new database name with prefix.
func Name(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + "_" + hex.EncodeToString(b)
}

// URL returns admin's connection string for database db.
func URL(admin, db string) (string, error) {
	cfg, err := pgx.ParseConfig(admin)
	if err != nil {
		return "", err
	}
	s := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, db)
	if cfg.Password != "" {
		s += " password='" + strings.ReplaceAll(cfg.Password, "'", `\'`) + "'"
	}
	return s, nil
}

// connect connects to database db as admin does.
func connect(ctx context.Context, admin, db string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(admin)
	if err != nil {
		return nil, err
	}
	cfg.Database = db
	return pgx.ConnectConfig(ctx, cfg)
}

// Get returns the process's template for key, created and migrated with
// migrate on first use; test databases are named with prefix.
func Get(ctx context.Context, admin, prefix, key string, migrate func(ctx context.Context, conn *pgx.Conn) error) (*Template, error) {
	mu.Lock()
	if tp, ok := templates[key]; ok {
		mu.Unlock()
		return tp, nil
	}
	b, ok := building[key]
	if !ok {
		b = &sync.Mutex{}
		building[key] = b
	}
	mu.Unlock()
	b.Lock()
	defer b.Unlock()
	mu.Lock()
	tp, ok := templates[key]
	mu.Unlock()
	if ok {
		return tp, nil
	}
	tp = &Template{admin: admin, name: Name(prefix + "_tmpl"), prefix: prefix}
	if err := tp.create(ctx, migrate); err != nil {
		return nil, err
	}
	mu.Lock()
	templates[key] = tp
	mu.Unlock()
	return tp, nil
}

func (tp *Template) create(ctx context.Context, migrate func(ctx context.Context, conn *pgx.Conn) error) error {
	admin, err := pgx.Connect(ctx, tp.admin)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL (run scripts/ensure-postgres.sh): %w", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "create database "+tp.name); err != nil {
		return fmt.Errorf("create template database: %w", err)
	}
	conn, err := connect(ctx, tp.admin, tp.name)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := migrate(ctx, conn); err != nil {
		return err
	}
	return tp.learn(ctx, conn)
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

// learn records what a database must match to be reused.
func (tp *Template) learn(ctx context.Context, conn *pgx.Conn) error {
	if err := conn.QueryRow(ctx, shapeSQL).Scan(&tp.shape); err != nil {
		return fmt.Errorf("read the template's catalogue: %w", err)
	}
	rows, err := conn.Query(ctx, tablesSQL)
	if err != nil {
		return fmt.Errorf("list the template's tables: %w", err)
	}
	if tp.all, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		return fmt.Errorf("list the template's tables: %w", err)
	}
	tp.kept = map[string]string{}
	for _, t := range tp.all {
		var js *string
		if err := conn.QueryRow(ctx, `select json_agg(t) from `+t+` t`).Scan(&js); err != nil {
			return fmt.Errorf("read template table %s: %w", t, err)
		}
		if js != nil {
			tp.kept[t] = *js
		}
	}
	if err := conn.QueryRow(ctx, seqsSQL).Scan(&tp.seqs); err != nil {
		return fmt.Errorf("read the template's sequences: %w", err)
	}
	return nil
}

// Take returns a database in the template's state: one kept for reuse,
// or a new clone.
func (tp *Template) Take(ctx context.Context) (string, error) {
	tp.mu.Lock()
	if n := len(tp.free); n > 0 {
		name := tp.free[n-1]
		tp.free = tp.free[:n-1]
		tp.mu.Unlock()
		tp.reused.Add(1)
		return name, nil
	}
	tp.mu.Unlock()
	admin, err := pgx.Connect(ctx, tp.admin)
	if err != nil {
		return "", fmt.Errorf("connect to PostgreSQL (run scripts/ensure-postgres.sh): %w", err)
	}
	defer admin.Close(ctx)
	name := Name(tp.prefix)
	if _, err := admin.Exec(ctx, "create database "+name+" template "+tp.name); err != nil {
		return "", fmt.Errorf("create test database: %w", err)
	}
	tp.created.Add(1)
	return name, nil
}

// Release ends what still connects to database name, then brings it back
// to the template's state and keeps it (when the process is Managed), or
// drops it.
func (tp *Template) Release(ctx context.Context, name string) error {
	admin, err := pgx.Connect(ctx, tp.admin)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer admin.Close(ctx)
	if Managed() {
		if _, err := admin.Exec(ctx, `select pg_terminate_backend(pid) from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()`, name); err == nil && tp.reset(ctx, name) == nil {
			tp.mu.Lock()
			tp.free = append(tp.free, name)
			tp.mu.Unlock()
			return nil
		}
	}
	return drop(ctx, admin, name)
}

// reset empties database name and puts the template's rows back, after
// checking that nothing else differs from the template.
func (tp *Template) reset(ctx context.Context, name string) error {
	conn, err := connect(ctx, tp.admin, name)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var shape string
	if err := conn.QueryRow(ctx, shapeSQL).Scan(&shape); err != nil {
		return err
	}
	if shape != tp.shape {
		return fmt.Errorf("database %s: its catalogue differs from the template's", name)
	}
	b := &pgx.Batch{}
	if len(tp.all) > 0 {
		b.Queue(`truncate ` + strings.Join(tp.all, ", ") + ` restart identity`)
	}
	for t, rows := range tp.kept {
		b.Queue(`insert into `+t+` select * from json_populate_recordset(null::`+t+`, $1)`, rows)
	}
	b.Queue(seqsSQL)
	var seqs string
	res := conn.SendBatch(ctx, b)
	for range b.Len() - 1 {
		if _, err := res.Exec(); err != nil {
			_ = res.Close()
			return err
		}
	}
	if err := res.QueryRow().Scan(&seqs); err != nil {
		_ = res.Close()
		return err
	}
	if err := res.Close(); err != nil {
		return err
	}
	if seqs != tp.seqs {
		return fmt.Errorf("database %s: its sequences differ from the template's", name)
	}
	return nil
}

func drop(ctx context.Context, admin *pgx.Conn, name string) error {
	_, err := admin.Exec(ctx, "drop database if exists "+name+" with (force)")
	return err
}

// Cleanup drops every template and kept database of the process, and
// returns a line a test binary may print: how many databases its tests
// took, and how many of those it created.
func Cleanup(ctx context.Context, admin string) string {
	mu.Lock()
	all := templates
	templates = map[string]*Template{}
	mu.Unlock()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return ""
	}
	defer conn.Close(ctx)
	var took, created int64
	for _, tp := range all {
		tp.mu.Lock()
		free := tp.free
		tp.free = nil
		tp.mu.Unlock()
		for _, name := range free {
			_ = drop(ctx, conn, name)
		}
		_ = drop(ctx, conn, tp.name)
		c := tp.created.Load()
		took, created = took+c+tp.reused.Load(), created+c
	}
	if took == 0 {
		return ""
	}
	return fmt.Sprintf("test databases: %d taken, %d created, %d reused", took, created, took-created)
}
