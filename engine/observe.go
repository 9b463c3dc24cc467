package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
)

// Ready reports whether this engine can do its work: started, the database
// reachable and migrated, the broker connected. The error says what is
// missing.
func (e *Engine) Ready(ctx context.Context) error {
	e.mu.Lock()
	running := e.run != nil
	e.mu.Unlock()
	if !running {
		return errors.New("engine not started")
	}
	if err := e.cfg.Pool.Ping(ctx); err != nil {
		return fmt.Errorf("database unreachable: %w", err)
	}
	if err := checkMigrated(ctx, e.cfg.Pool, e.cfg.Schema); err != nil {
		return err
	}
	if st := e.cfg.NATS.Status(); st != nats.CONNECTED {
		return fmt.Errorf("broker not connected (connection %s)", st)
	}
	return nil
}
