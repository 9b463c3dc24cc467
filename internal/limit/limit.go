// Package limit takes an attempt's turn under the limits another system
// sets (saga.Limit), kept in the engine's database so that they hold
// across every process: a hold per call for the concurrency bounds (the
// limit's own and its key's), and a reserved start for the rate.
//
// A turn is taken before the attempt claims its call, so a wait spends
// no attempt, and a process that dies while it waits leaves no outcome
// that looks unknown; the caller's keep function pushes the attempt's
// lease while it waits. Holds lapse at their deadline if their process
// dies, and are pushed forward with the attempt's lease.
package limit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Polling bounds while a concurrency bound is full: holds released by
// this process wake its waiters at once; others' are seen by polling.
const (
	pollMin = 10 * time.Millisecond
	pollMax = 500 * time.Millisecond
)

// KeepFunc pushes the waiting attempt's lease forward; an error (the
// attempt lost its step) ends the wait.
type KeepFunc func(ctx context.Context) error

// Check returns an error when two steps of defs give one limit's name
// different bounds: they share one limit, which has one set.
func Check(defs []*saga.Definition) error {
	type use struct {
		l     saga.Limit
		where string
	}
	seen := map[string]use{}
	for _, d := range defs {
		for _, s := range d.Steps() {
			if s.Limit.IsZero() {
				continue
			}
			where := d.Ref() + " step " + s.Name
			u, ok := seen[s.Limit.Name]
			if !ok {
				seen[s.Limit.Name] = use{s.Limit, where}
				continue
			}
			if !sameBounds(u.l, s.Limit) {
				return fmt.Errorf("idemsaga: limit %q has other bounds in %s (%s) than in %s (%s); steps that share a limit's name share one limit: give them the same bounds, or other names",
					s.Limit.Name, where, s.Limit, u.where, u.l)
			}
		}
	}
	return nil
}

// sameBounds reports whether two limits bound alike.
func sameBounds(a, b saga.Limit) bool {
	return a.Concurrency == b.Concurrency && a.Rate == b.Rate && a.Per == b.Per && a.PerKey == b.PerKey
}

// Gate takes turns under limits for the attempts of one process.
type Gate struct {
	pool    *pgxpool.Pool
	schema  *pgschema.Schema
	metrics *metrics.Metrics

	mu sync.Mutex
	// released wake this process's waiters for a (limit, scope) when it
	// releases a hold there; an entry lives while someone waits.
	released map[string]*waiters
}

type waiters struct {
	ch chan struct{}
	n  int
}

// New returns a gate over pool, whose tables are in schema.
func New(pool *pgxpool.Pool, schema *pgschema.Schema, m *metrics.Metrics) *Gate {
	return &Gate{pool: pool, schema: schema, metrics: m, released: map[string]*waiters{}}
}

// Attempt is the attempt that takes a turn, and how it keeps its lease
// while it waits.
type Attempt struct {
	// Key is the call's key for the limit's per-key bound (KeyFunc), ""
	// for none.
	Key string
	// Hold is how long a hold lasts unless pushed forward: the attempt's
	// lease.
	Hold time.Duration
	// Every is how often Keep is called while the turn waits.
	Every time.Duration
	Keep  KeepFunc
}

// Turn is an attempt's turn under a limit: the holds it took, given back
// with Release.
type Turn struct {
	g *Gate
	l saga.Limit
	a Attempt
	// holder names the turn's holds: its own, never shared with another
	// delivery of the same attempt.
	holder uuid.UUID
	kept   time.Time
	// spare is a start under the rate that Wait reserved and no call
	// has used yet (Pace takes it first).
	spare bool

	// mu guards scopes: a handler's heartbeat (Extend) may run on a
	// goroutine of its own while the turn is released.
	mu     sync.Mutex
	scopes []string
}

type bound struct {
	scope, name string
	n           int
}

// Wait takes a's turn under l: a hold under the limit's per-key bound,
// then under its own bound, then a start under its rate, waiting for
// each as long as it takes. It gives back what it took if ctx ends or
// Keep fails, and returns that error.
func (g *Gate) Wait(ctx context.Context, l saga.Limit, a Attempt) (*Turn, error) {
	t := &Turn{g: g, l: l, a: a, holder: uuid.New(), kept: time.Now()}
	start := time.Now()
	var bounds []bound
	if l.PerKey > 0 && a.Key != "" {
		bounds = append(bounds, bound{scope: a.Key, name: "per_key", n: l.PerKey})
	}
	if l.Concurrency > 0 {
		bounds = append(bounds, bound{scope: "", name: "concurrency", n: l.Concurrency})
	}
	for _, b := range bounds {
		if err := t.hold(ctx, b); err != nil {
			t.Release(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	if _, err := t.Pace(ctx); err != nil {
		t.Release(context.WithoutCancel(ctx))
		return nil, err
	}
	t.spare = l.Rate > 0
	waited := time.Since(start)
	g.metrics.LimitWaitSeconds.WithLabelValues(l.Name).Observe(waited.Seconds())
	if waited > pollMin {
		// The lease and the holds start the call whole.
		if err := t.keep(ctx, true); err != nil {
			t.Release(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	return t, nil
}

// hold takes a hold under bound b, waiting until one is free.
func (t *Turn) hold(ctx context.Context, b bound) error {
	delay := pollMin
	for waited := false; ; {
		wake, done := t.g.wakeOn(t.l.Name, b.scope)
		ok, err := t.g.take(ctx, t.l.Name, b.scope, t.holder, b.n, t.a.Hold)
		if err != nil {
			done()
			return fmt.Errorf("take a hold under limit %s: %w", t.l.Name, err)
		}
		if ok {
			done()
			t.mu.Lock()
			t.scopes = append(t.scopes, b.scope)
			t.mu.Unlock()
			return nil
		}
		if !waited {
			waited = true
			t.g.metrics.LimitWaits.WithLabelValues(t.l.Name, b.name).Inc()
		}
		timer := time.NewTimer(delay/2 + rand.N(delay/2+1))
		select {
		case <-ctx.Done():
			timer.Stop()
			done()
			return ctx.Err()
		case <-wake:
			timer.Stop()
		case <-timer.C:
		}
		done()
		delay = min(2*delay, pollMax)
		if err := t.keep(ctx, false); err != nil {
			return err
		}
	}
}

// Pace waits for one start under the limit's rate, if it has one, for
// one call of the turn: the first takes the start Wait reserved, each
// other (the step's Verify beside its call) one of its own. It reports
// whether it waited.
func (t *Turn) Pace(ctx context.Context) (bool, error) {
	if t == nil || t.l.Rate <= 0 {
		return false, nil
	}
	if t.spare {
		t.spare = false
		return false, nil
	}
	var ms float64
	if err := t.g.schema.Q(t.g.pool).QueryRow(ctx, store.ReserveRate, t.l.Name, t.l.Spacing().Microseconds()).Scan(&ms); err != nil {
		return false, fmt.Errorf("reserve a start under limit %s: %w", t.l.Name, store.Interpret(err))
	}
	if ms < 1 {
		return false, nil
	}
	t.g.metrics.LimitWaits.WithLabelValues(t.l.Name, "rate").Inc()
	until := time.Now().Add(time.Duration(ms * float64(time.Millisecond)))
	for {
		left := time.Until(until)
		if left <= 0 {
			return true, nil
		}
		timer := time.NewTimer(min(left, t.a.Every))
		select {
		case <-ctx.Done():
			timer.Stop()
			return true, ctx.Err()
		case <-timer.C:
		}
		if err := t.keep(ctx, false); err != nil {
			return true, err
		}
	}
}

// keep calls the attempt's Keep and pushes the turn's holds, once Every
// passed since the last time (or now, if force).
func (t *Turn) keep(ctx context.Context, force bool) error {
	if !force && time.Since(t.kept) < t.a.Every {
		return nil
	}
	t.kept = time.Now()
	if t.a.Keep != nil {
		if err := t.a.Keep(ctx); err != nil {
			return err
		}
	}
	return t.Extend(ctx)
}

// Extend pushes the turn's holds to Hold from now.
func (t *Turn) Extend(ctx context.Context) error {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	held := len(t.scopes) > 0
	t.mu.Unlock()
	if !held {
		return nil
	}
	if _, err := t.g.schema.Q(t.g.pool).Exec(ctx, store.ExtendHolds, pguuid.Of(t.holder), t.a.Hold.Milliseconds()); err != nil {
		return fmt.Errorf("extend the holds under limit %s: %w", t.l.Name, store.Interpret(err))
	}
	return nil
}

// Release gives back the turn's holds, and wakes this process's waiters
// for them. A hold it cannot give back (the database out of reach)
// lapses at its deadline. Safe on nil and twice.
func (t *Turn) Release(ctx context.Context) {
	if t == nil {
		return
	}
	t.mu.Lock()
	scopes := t.scopes
	t.scopes = nil
	t.mu.Unlock()
	if len(scopes) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, _ = t.g.schema.Q(t.g.pool).Exec(rctx, store.ReleaseHolds, pguuid.Of(t.holder))
	for _, s := range scopes {
		t.g.wake(t.l.Name, s)
	}
}

// take tries, once, to take a hold of limit name's scope for holder,
// lasting hold, under a bound of n.
func (g *Gate) take(ctx context.Context, name, scope string, holder uuid.UUID, n int, hold time.Duration) (bool, error) {
	var ok bool
	err := g.pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
		tx := store.Implicit(c.Conn(), g.schema)
		tx.Exec(store.LockLimit, nil, name, scope)
		tx.Queue(store.TakeHold, func(row pgx.Row) error {
			var one int
			err := row.Scan(&one)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			ok = err == nil
			return err
		}, name, scope, pguuid.Of(holder), n, hold.Milliseconds())
		return tx.Commit(ctx)
	})
	return ok, store.Interpret(err)
}

// wakeOn returns what wakes a waiter for a hold of limit name's scope
// when this process releases one there, and done, which the waiter calls
// when it stops waiting on it.
func (g *Gate) wakeOn(name, scope string) (<-chan struct{}, func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := name + "/" + scope
	w, ok := g.released[k]
	if !ok {
		w = &waiters{ch: make(chan struct{})}
		g.released[k] = w
	}
	w.n++
	return w.ch, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if w.n--; w.n == 0 && g.released[k] == w {
			delete(g.released, k)
		}
	}
}

func (g *Gate) wake(name, scope string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := name + "/" + scope
	if w, ok := g.released[k]; ok {
		close(w.ch)
		delete(g.released, k)
	}
}
