package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// freshDatabase drops and creates database name on the DATABASE_URL
// server, applies the migrations and returns its connection string with a
// pool of maxConns connections. The demo, chaos and bench commands start
// from one each run.
func freshDatabase(ctx context.Context, g *globals, name string, maxConns int32) (string, *pgxpool.Pool, error) {
	if !validDBName(name) {
		return "", nil, fmt.Errorf("--db-name %q must be lowercase letters, digits and '_'", name)
	}
	admin, err := openDB(ctx, g.DatabaseURL, 1)
	if err != nil {
		return "", nil, err
	}
	defer admin.Close()
	for _, q := range []string{"drop database if exists " + name + " with (force)", "create database " + name} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return "", nil, fmt.Errorf("prepare database %q: %w (the DATABASE_URL user needs CREATEDB)", name, err)
		}
	}
	dsn, err := withDBName(g.DatabaseURL, name)
	if err != nil {
		return "", nil, err
	}
	pool, err := openDB(ctx, dsn, maxConns)
	if err != nil {
		return "", nil, err
	}
	if err := migrateAll(ctx, pool); err != nil {
		pool.Close()
		return "", nil, err
	}
	return dsn, pool, nil
}
