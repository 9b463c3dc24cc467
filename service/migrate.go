package service

import (
	"context"
	"fmt"
	"io/fs"
	"strings"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/migrations"
)

// MigrationFiles returns the folder of m's .sql files: the root of
// m.Files, or its migrations folder.
func MigrationFiles(m Migration) (fs.FS, error) { return m.files() }

func (m Migration) files() (fs.FS, error) {
	entries, err := fs.ReadDir(m.Files, ".")
	if err != nil {
		return nil, fmt.Errorf("migrations of schema %s: %w", m.Schema, err)
	}
	for _, e := range entries {
		if !e.IsDir() && strings.HasSuffix(e.Name(), ".sql") {
			return m.Files, nil
		}
	}
	sub, err := fs.Sub(m.Files, "migrations")
	if err == nil {
		if entries, err := fs.ReadDir(sub, "."); err == nil && len(entries) > 0 {
			return sub, nil
		}
	}
	return nil, fmt.Errorf("migrations of schema %s: no .sql files at the root of Files or in its migrations folder", m.Schema)
}

type migrateCmd struct {
	NoRecord bool `name:"no-record" help:"Apply the migrations only; leave the deployment's recorded settings and definitions as they are."`
}

func (c *migrateCmd) Run(ctx context.Context, f *Flags) error {
	pool, err := f.OpenDB(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if err := migrations.MigrateSchema(ctx, conn.Conn(), f.Schema); err != nil {
		return err
	}
	v, _ := migrations.Latest()
	fmt.Fprintf(f.out, "engine schema %s at version %d\n", f.Schema, v)
	for _, m := range f.cfg.Migrations {
		files, err := m.files()
		if err != nil {
			return err
		}
		if err := migrations.Apply(ctx, conn.Conn(), m.Schema, files); err != nil {
			return err
		}
		have, _, err := migrations.CheckApplied(ctx, conn.Conn(), m.Schema, files)
		if err != nil {
			return err
		}
		fmt.Fprintf(f.out, "schema %s at version %d\n", m.Schema, have)
	}
	if c.NoRecord {
		return nil
	}
	if err := engine.Deploy(ctx, f.EngineConfig(pool)); err != nil {
		return err
	}
	fmt.Fprintf(f.out, "deployment: stream %s, subject prefix %s, lease grace %s; definitions %s\n",
		f.Stream, f.SubjectPrefix, f.LeaseGrace, strings.Join(definitionNames(f.defs), ", "))
	if cl, err := f.Client(pool); err == nil {
		if ws, err := cl.Workers(ctx); err == nil && len(ws) > 0 {
			fmt.Fprintf(f.errOut, "%d workers are running (see `%s workers`): each keeps the settings and definitions it started with until restarted; restart those of another build\n", len(ws), name(*f.cfg))
		}
	}
	return nil
}
