// Package pgschema runs the engine's SQL, written against schema idemsaga, in a
// deployment's own schema.
package pgschema

import (
	"context"
	"fmt"
	"regexp"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SchemaDefault is the PostgreSQL schema of a deployment that names none.
const SchemaDefault = "idemsaga"

// schemaName is what a deployment's schema may be called: a lower-case
// identifier that needs no quoting.
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// tableRef finds the engine's objects in its SQL, which names them in
// schema idemsaga (also inside a regclass literal such as
// 'idemsaga.outbox').
var tableRef = regexp.MustCompile(`\bidemsaga\.`)

// Schema is the PostgreSQL schema a deployment's tables live in. The
// engine's SQL is written against schema idemsaga; SQL rewrites a
// statement for the deployment's schema (once per statement text, then
// from a cache). The default schema's statements are used as written.
type Schema struct {
	name  string
	cache sync.Map // statement as written → statement for this schema
}

var defaultSchema = &Schema{name: SchemaDefault}

// New returns the schema called name; "" is SchemaDefault.
func New(name string) (*Schema, error) {
	if name == "" || name == SchemaDefault {
		return defaultSchema, nil
	}
	if err := Check(name); err != nil {
		return nil, err
	}
	return &Schema{name: name}, nil
}

// Check says what is wrong with a schema name, nil when nothing; "" is
// SchemaDefault.
func Check(name string) error {
	if name == "" {
		return nil
	}
	if !schemaName.MatchString(name) || name == "public" || name == "information_schema" || (len(name) >= 3 && name[:3] == "pg_") {
		return fmt.Errorf("the schema %q is not a name the engine can use: give 1 to 63 lower-case letters, digits and '_', starting with a letter or '_', other than public, information_schema or pg_…", name)
	}
	return nil
}

// Name returns the schema's name.
func (s *Schema) Name() string {
	if s == nil {
		return SchemaDefault
	}
	return s.name
}

// SQL returns q, written against schema idemsaga, for this schema.
func (s *Schema) SQL(q string) string {
	if s == nil || s.name == SchemaDefault {
		return q
	}
	if v, ok := s.cache.Load(q); ok {
		return v.(string)
	}
	out := tableRef.ReplaceAllLiteralString(q, s.name+".")
	s.cache.Store(q, out)
	return out
}

// Executor runs statements: a pool, a connection or a transaction.
type Executor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Q returns e running the engine's statements in this schema.
func (s *Schema) Q(e Executor) Executor {
	if s == nil || s.name == SchemaDefault {
		return e
	}
	return schemaExecutor{e, s}
}

type schemaExecutor struct {
	e Executor
	s *Schema
}

func (x schemaExecutor) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return x.e.Exec(ctx, x.s.SQL(sql), args...)
}

func (x schemaExecutor) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return x.e.Query(ctx, x.s.SQL(sql), args...)
}

func (x schemaExecutor) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return x.e.QueryRow(ctx, x.s.SQL(sql), args...)
}

// SendBatch rewrites the batch's statements in place.
func (x schemaExecutor) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		q.SQL = x.s.SQL(q.SQL)
	}
	return x.e.SendBatch(ctx, b)
}
