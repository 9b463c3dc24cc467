package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/migrations"
)

type migrateCmd struct{}

func (migrateCmd) Run(ctx context.Context, g *globals) error {
	pool, err := openDB(ctx, g.DatabaseURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrateAll(ctx, pool); err != nil {
		return err
	}
	v, _ := migrations.Latest()
	fmt.Printf("migrated: engine schema at version %d, transfer example tables ready\n", v)
	return nil
}

func migrateAll(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if err := migrations.Migrate(ctx, conn.Conn()); err != nil {
		return err
	}
	return transfer.Migrate(ctx, conn.Conn())
}

// checkTransferMigrated fails when the transfer tables lack this build's
// migrations (the engine checks its own at start).
func checkTransferMigrated(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	defer conn.Release()
	return transfer.CheckMigrated(ctx, conn.Conn())
}
