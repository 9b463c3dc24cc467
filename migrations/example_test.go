package migrations_test

import (
	"context"
	"fmt"

	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/migrations"
)

// Migrate applies what is missing, and Check tells a database migrated by
// this build from one that needs `migrate`.
func Example() {
	infra := exampleenv.New() // its database already holds the engine's tables
	defer infra.Close()
	ctx := context.Background()
	conn, _ := infra.Pool.Acquire(ctx)
	defer conn.Release()

	if err := migrations.Migrate(ctx, conn.Conn()); err != nil { // again: nothing to do
		panic(err)
	}
	have, want, err := migrations.Check(ctx, conn.Conn())
	fmt.Println(have == want, err)
	// Output: true <nil>
}
