package testenv

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RoundTrips is a pgx tracer (pgxpool.Config.ConnConfig.Tracer) that
// counts what a connection sends to PostgreSQL: batches, and statements
// sent alone, each a round trip of its own.
type RoundTrips struct {
	Batches, Alone atomic.Int32
	mu             sync.Mutex
	alone          []string // the statements sent alone, in order
	batched        []string // the statements of batches whose results were read, in order
}

// Reset forgets what was counted so far.
func (r *RoundTrips) Reset() {
	r.Batches.Store(0)
	r.Alone.Store(0)
	r.mu.Lock()
	r.alone, r.batched = nil, nil
	r.mu.Unlock()
}

// SentAlone returns the statements sent alone since the last Reset.
func (r *RoundTrips) SentAlone() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.alone)
}

// SentInBatches returns the statements of batches since the last Reset,
// those whose results were read, in order.
func (r *RoundTrips) SentInBatches() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.batched)
}

// TraceQueryStart counts a statement sent alone.
func (r *RoundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.Alone.Add(1)
	r.mu.Lock()
	r.alone = append(r.alone, d.SQL)
	r.mu.Unlock()
	return ctx
}

// TraceQueryEnd does nothing.
func (r *RoundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart counts a batch.
func (r *RoundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.Batches.Add(1)
	return ctx
}

// TraceBatchQuery records a statement of a batch.
func (r *RoundTrips) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.mu.Lock()
	r.batched = append(r.batched, d.SQL)
	r.mu.Unlock()
}

// TraceBatchEnd does nothing.
func (r *RoundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// CountRoundTrips returns a pool on shared's database whose connections
// count their round trips in the returned RoundTrips; the pool is closed
// when the test ends.
func CountRoundTrips(t testing.TB, shared *pgxpool.Pool) (*pgxpool.Pool, *RoundTrips) {
	t.Helper()
	counted := &RoundTrips{}
	cfg := shared.Config().Copy()
	cfg.ConnConfig.Tracer = counted
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("open a pool that counts round trips: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, counted
}
