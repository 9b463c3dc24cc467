package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/migrations"
)

func migrateAll(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	for _, m := range []func(context.Context, *pgx.Conn) error{migrations.Migrate, transfer.Migrate, order.Migrate, payments.Migrate, crossborder.Migrate, settlement.Migrate} {
		if err := m(ctx, conn.Conn()); err != nil {
			return err
		}
	}
	return nil
}

// checkExamplesMigrated fails, saying to run `worker migrate`, when the
// engine's or the examples' tables lack this build's migrations.
func checkExamplesMigrated(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.Check(ctx, conn.Conn()); err != nil {
		return err
	}
	if err := transfer.CheckMigrated(ctx, conn.Conn()); err != nil {
		return err
	}
	return order.CheckMigrated(ctx, conn.Conn())
}
