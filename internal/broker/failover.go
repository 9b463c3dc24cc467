package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Advisory subjects JetStream publishes when a replicated stream or
// consumer elects a new leader.
const (
	streamLeaderElected   = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED."
	consumerLeaderElected = "$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED."
)

// FailoverConfig describes what RedeliverOnFailover watches.
type FailoverConfig struct {
	// Stream whose leader changes are watched, and the prefixes of the
	// durable names of its consumers to redeliver: every consumer of the
	// stream whose name has one, whichever process made it (the
	// consumers of definitions another service runs too).
	Stream           string
	ConsumerPrefixes []string
	// Group is the queue group the advisories are taken in, so that one
	// process of a deployment acts on each election. Defaults to
	// "idemsaga-failover." + Stream.
	Group string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// RedeliverOnFailover makes a leader failover cost seconds, not an ack
// wait. When the stream or one of the consumers elects a new leader, what
// the lost leader held is gone: deliveries in flight to a worker and acks
// in flight from one. The new leader counts those messages as delivered
// and not acked, and redelivers them only after AckWait; meanwhile they
// stay in the work queue, and a step whose command was lost waits that
// long (or its lease). On each election one process (the advisory's queue
// group) resets the consumers to the stream's first message: everything
// still in the work queue is delivered again now, and the workers absorb
// what they already did (inbox, fenced attempts) and ack it. The same
// reset follows this connection's own reconnection to a clustered server,
// since it may have missed the advisories meanwhile (not to a lone server,
// which elects no leaders), and any message a subscription of this
// connection dropped as a slow consumer: after a reconnection the client
// asks anew without counting what it had asked for before (still in its
// buffer, or held for it by a consumer leader that lives on), and what it
// is then sent beyond its buffer is dropped and held as delivered until
// AckWait. To see the
// drops it chains a handler before the connection's error handler
// (nats.Conn.SetErrorHandler), which it still calls. It returns once
// subscribed; the subscription ends with ctx. Without permission to
// subscribe to the advisories it returns an error, and failovers fall
// back to AckWait and leases.
func RedeliverOnFailover(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, cfg FailoverConfig) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	group := cfg.Group
	if group == "" {
		group = "idemsaga-failover." + cfg.Stream
	}
	elected := make(chan string, 1)
	handle := func(m *nats.Msg) {
		if c, ok := strings.CutPrefix(m.Subject, consumerLeaderElected+cfg.Stream+"."); ok && !hasPrefix(c, cfg.ConsumerPrefixes) {
			return // a consumer of the stream the engine does not use
		}
		select {
		case elected <- m.Subject:
		default: // a reset is already due; it covers this one
		}
	}
	subjects := []string{streamLeaderElected + cfg.Stream, consumerLeaderElected + cfg.Stream + ".*"}
	var subs []*nats.Subscription
	unsubscribe := func() {
		for _, s := range subs {
			_ = s.Unsubscribe()
		}
	}
	for _, subj := range subjects {
		s, err := nc.QueueSubscribe(subj, group, handle)
		if err != nil {
			unsubscribe()
			return fmt.Errorf("subscribe to JetStream leader advisories %s: %w; grant subscribe on $JS.EVENT.ADVISORY.> or failovers wait for AckWait", subj, err)
		}
		subs = append(subs, s)
	}
	if err := nc.Flush(); err != nil {
		unsubscribe()
		return fmt.Errorf("subscribe to JetStream leader advisories: %w", err)
	}
	dropped := make(chan struct{}, 1)
	watchDrops(ctx, nc, dropped)
	go func() {
		defer unsubscribe()
		// This connection's own loss of its server is a failover it may
		// have missed the advisories of (it was reconnecting then).
		reconnects := nc.Stats().Reconnects
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			var why string
			select {
			case <-ctx.Done():
				return
			case subj := <-elected:
				why = strings.TrimPrefix(subj, "$JS.EVENT.ADVISORY.")
			case <-dropped:
				why = "a subscription of this connection dropped messages (slow consumer)"
			case <-tick.C:
				n := nc.Stats().Reconnects
				if n == reconnects || !nc.IsConnected() {
					continue
				}
				reconnects = n
				if nc.ConnectedClusterName() == "" {
					// A lone server elects no leaders: what it held
					// comes back with its restart, and every process
					// resetting after it would be a storm of duplicates.
					continue
				}
				why = "this process reconnected to NATS"
			}
			// Elections come in bursts (the stream, then each consumer):
			// one reset after they settle covers them all.
			select {
			case <-ctx.Done():
				return
			case <-time.After(failoverSettle):
			}
			select {
			case <-elected:
			default:
			}
			select {
			case <-dropped:
			default:
			}
			log.Info("JetStream failover: redelivering what the work queue still holds", "stream", cfg.Stream, "cause", why)
			redeliver(ctx, js, cfg.Stream, cfg.ConsumerPrefixes, log)
		}
	}()
	return nil
}

// watchDrops chains a handler before nc's error handler that signals
// dropped (without blocking) each time one of nc's subscriptions starts
// dropping messages, until ctx ends; the handler before it is called as
// it was.
func watchDrops(ctx context.Context, nc *nats.Conn, dropped chan<- struct{}) {
	next := nc.ErrorHandler()
	nc.SetErrorHandler(func(c *nats.Conn, sub *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrSlowConsumer) && ctx.Err() == nil {
			select {
			case dropped <- struct{}{}:
			default: // a reset is already due; it covers this one
			}
		}
		if next != nil {
			next(c, sub, err)
		}
	})
}

// failoverSettle is how long a reset waits for the other elections of
// the same failover.
const failoverSettle = 500 * time.Millisecond

// hasPrefix reports whether name has one of prefixes.
func hasPrefix(name string, prefixes []string) bool {
	return slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(name, p) })
}

// redeliver resets every consumer of the stream whose name has one of
// prefixes to the stream's first message, trying for about 30 seconds
// while the new leaders settle.
func redeliver(ctx context.Context, js jetstream.JetStream, stream string, prefixes []string, log *slog.Logger) {
	var pending []string
	listed := false
	for try, delay := 0, 100*time.Millisecond; ; try, delay = try+1, min(2*delay, 5*time.Second) {
		var err error
		if !listed {
			pending, err = consumersOf(ctx, js, stream, prefixes)
			listed = err == nil
		}
		if listed {
			if pending, err = resetAll(ctx, js, stream, pending); len(pending) == 0 {
				return
			}
		}
		if ctx.Err() != nil {
			return
		}
		if try >= 10 {
			log.Warn("JetStream leader elected, but its consumers could not be reset; what the old leader held is redelivered after AckWait",
				"stream", stream, "consumers", strings.Join(pending, ","), "error", err)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// consumersOf lists the consumers of stream whose names have one of
// prefixes; nil and the error when it cannot.
func consumersOf(ctx context.Context, js jetstream.JetStream, stream string, prefixes []string) ([]string, error) {
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := js.Stream(lctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil // a server that lost everything: consumers start anew
	}
	if err != nil {
		return nil, err
	}
	var out []string
	names := s.ConsumerNames(lctx)
	for n := range names.Name() {
		if hasPrefix(n, prefixes) {
			out = append(out, n)
		}
	}
	return out, names.Err()
}

// resetAll resets each consumer to the stream's first message and
// returns those it could not reset, with the last error.
func resetAll(ctx context.Context, js jetstream.JetStream, stream string, consumers []string) ([]string, error) {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := js.Stream(rctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil // a server that lost everything: consumers start anew
	}
	if err != nil {
		return consumers, err
	}
	st := s.CachedInfo().State
	if st.Msgs == 0 {
		return nil, nil // nothing left to redeliver
	}
	var failed []string
	var last error
	for _, c := range consumers {
		if _, err := js.ResetConsumerToSequence(rctx, stream, c, st.FirstSeq); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			failed, last = append(failed, c), err
		}
	}
	return failed, last
}
