package sagatest

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Clock is the engine's clock in a test: the database's clock plus an
// offset the test moves forward. Leases, retry times and retention are
// all measured by it (idemsaga.now()), so moving it makes them come due;
// in production the engine uses the database's clock as it is.
type Clock struct{ pool *pgxpool.Pool }

// Now returns the engine's time.
func (c *Clock) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := c.pool.QueryRow(ctx, `select idemsaga.now()`).Scan(&t); err != nil {
		return t, fmt.Errorf("sagatest: read the clock: %w", err)
	}
	return t, nil
}

// Advance moves the engine's time forward by d.
func (c *Clock) Advance(ctx context.Context, d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("sagatest: the clock only moves forward; Advance(%s)", d)
	}
	if _, err := c.pool.Exec(ctx, `update sagatest.clock set offset_ms = offset_ms + $1`, d.Milliseconds()); err != nil {
		return fmt.Errorf("sagatest: move the clock: %w", err)
	}
	return nil
}

// Offset returns how far the test moved the clock.
func (c *Clock) Offset(ctx context.Context) (time.Duration, error) {
	var ms int64
	if err := c.pool.QueryRow(ctx, `select offset_ms from sagatest.clock`).Scan(&ms); err != nil {
		return 0, fmt.Errorf("sagatest: read the clock: %w", err)
	}
	return time.Duration(ms) * time.Millisecond, nil
}
