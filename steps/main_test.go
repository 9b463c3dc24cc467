package steps_test

import (
	"context"
	"testing"

	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) { testenv.Main(m, fixture.Migrate, migrateEffects) }

// migrateEffects adds the table handlers write their effects to
// (effectsDB).
func migrateEffects(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, `create table effects (saga_id uuid not null, step text not null)`)
	return err
}
