// Package migrations holds the engine's SQL schema as numbered, embedded
// files and applies them with github.com/jackc/tern/v2/migrate.
//
// Migrate is safe to call from many processes at once: it holds a
// PostgreSQL advisory lock while it runs, and applies only what is missing.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"

	"github.com/idemsaga/idemsaga/internal/pgschema"
)

//go:embed *.sql
var files embed.FS

// Schema is the PostgreSQL schema that holds the engine's tables.
const Schema = "idemsaga"

// lockKey serializes concurrent Migrate calls across processes.
const lockKey = 0x1de5a6a

// ahead explains a schema at a version this build does not know: migrated
// by a newer build, or by one from before the schemas were squashed into
// one commented baseline each (none of those was released).
func ahead(schema string, have, want int32) error {
	return fmt.Errorf("schema %s is at version %d, and this build knows %d: it was migrated by a newer build (run that one), "+
		"or by a build from before the baseline migration (drop schema %s cascade, or use a fresh database, then apply the migrations with the runtime's `migrate` command)", schema, have, want, schema)
}

// Migrate applies every engine migration not yet applied.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	return Apply(ctx, conn, Schema, files)
}

// MigrateSchema applies every engine migration not yet applied to the
// tables of a deployment of its own schema (engine.Config.Schema; "" for
// Schema).
func MigrateSchema(ctx context.Context, conn *pgx.Conn, schema string) error {
	sch, err := pgschema.New(schema)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return Apply(ctx, conn, sch.Name(), schemaFS{files, sch})
}

// CheckSchema is Check for a deployment of its own schema ("" for
// Schema).
func CheckSchema(ctx context.Context, conn *pgx.Conn, schema string) (have, want int32, err error) {
	sch, err := pgschema.New(schema)
	if err != nil {
		return 0, 0, err
	}
	return CheckApplied(ctx, conn, sch.Name(), files)
}

// schemaFS is the engine's migrations, written for schema idemsaga, for
// another schema.
type schemaFS struct {
	embed.FS
	sch *pgschema.Schema
}

// ReadFile returns the migration rewritten for the schema.
func (f schemaFS) ReadFile(name string) ([]byte, error) {
	b, err := f.FS.ReadFile(name)
	return []byte(f.sch.SQL(string(b))), err
}

// Latest returns the number of the newest engine migration.
func Latest() (int32, error) {
	names, err := migrate.FindMigrations(files)
	if err != nil {
		return 0, err
	}
	return int32(len(names)), nil
}

// Current returns the applied engine migration version, 0 when none.
func Current(ctx context.Context, conn *pgx.Conn) (int32, error) {
	return current(ctx, conn, Schema)
}

// current returns the migration version Apply recorded in schema, 0 when
// none. It looks the table up first, so that a fresh database writes no
// error to the server's log.
func current(ctx context.Context, conn *pgx.Conn, schema string) (int32, error) {
	table := pgx.Identifier{schema, "schema_version"}.Sanitize()
	var exists bool
	if err := conn.QueryRow(ctx, "select to_regclass($1) is not null", table).Scan(&exists); err != nil || !exists {
		return 0, err
	}
	var v int32
	err := conn.QueryRow(ctx, "select version from "+table).Scan(&v)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		return 0, nil // dropped meanwhile
	}
	return v, err
}

// Check reads the engine migration version the database has (have) and
// the one this build needs (want). It fails when the two differ: a
// database behind needs `migrate`; one ahead was migrated by
// another build.
func Check(ctx context.Context, conn *pgx.Conn) (have, want int32, err error) {
	return CheckApplied(ctx, conn, Schema, files)
}

// CheckApplied is Check for the numbered .sql files of fsys, applied to
// schema by Apply (another package's tables, such as the transfer
// example's).
func CheckApplied(ctx context.Context, conn *pgx.Conn, schema string, fsys fs.FS) (have, want int32, err error) {
	if have, err = current(ctx, conn, schema); err != nil {
		return 0, 0, fmt.Errorf("read the migration version of schema %s: %w", schema, err)
	}
	names, err := migrate.FindMigrations(fsys)
	if err != nil {
		return have, 0, fmt.Errorf("list the migrations of schema %s: %w", schema, err)
	}
	want = int32(len(names))
	if have > want {
		return have, want, ahead(schema, have, want)
	}
	if have < want {
		return have, want, fmt.Errorf("database schema %s is at version %d, this build needs %d: apply the migrations first (the runtime's `migrate` command, or migrations.Migrate)", schema, have, want)
	}
	return have, want, nil
}

// Apply applies the numbered .sql files of fsys to schema, recording the
// version in schema.schema_version. The schema is created when missing.
// Other packages (such as the transfer example) use it for their own tables.
func Apply(ctx context.Context, conn *pgx.Conn, schema string, fsys fs.FS) (err error) {
	if _, err := conn.Exec(ctx, "select pg_advisory_lock($1)", int64(lockKey)); err != nil {
		return fmt.Errorf("migrate %s: take the migration lock: %w", schema, err)
	}
	defer func() {
		if _, uerr := conn.Exec(context.WithoutCancel(ctx), "select pg_advisory_unlock($1)", int64(lockKey)); uerr != nil && err == nil {
			err = fmt.Errorf("migrate %s: release the migration lock: %w", schema, uerr)
		}
	}()
	if _, err := conn.Exec(ctx, "create schema if not exists "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("migrate %s: create schema: %w", schema, err)
	}
	if have, err := current(ctx, conn, schema); err != nil {
		return fmt.Errorf("migrate %s: read the migration version: %w", schema, err)
	} else if names, err := migrate.FindMigrations(fsys); err == nil && int(have) > len(names) {
		return ahead(schema, have, int32(len(names)))
	}
	m, err := migrate.NewMigrator(ctx, conn, schema+".schema_version")
	if err != nil {
		return fmt.Errorf("migrate %s: %w", schema, err)
	}
	if err := m.LoadMigrations(fsys); err != nil {
		return fmt.Errorf("migrate %s: load migrations: %w", schema, err)
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate %s: %w", schema, err)
	}
	return nil
}
