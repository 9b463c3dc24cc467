package httpapi_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m, migrateLedger) }

// migrateLedger creates the table the test saga's steps write to.
func migrateLedger(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, `create schema httpapi_test;
create table httpapi_test.ledger (
  saga_id uuid not null,
  step text not null,
  phase text not null,
  account bigint not null,
  amount bigint not null,
  primary key (saga_id, step, phase)
)`)
	return err
}
