// Package broker sets up the JetStream stream and durable consumers the
// engine uses, and runs a bounded pool of message handlers on a consumer.
//
// JetStream is transport, not the source of truth: every message it loses
// is re-driven from PostgreSQL by lease expiry, so the stream uses the
// server's default (lazy) fsync and consumers use plain acks.
package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// DuplicateWindowDefault is the stream's Nats-Msg-Id dedup window. It is a
// fast path only; the inbox and fenced updates are the guarantee.
const DuplicateWindowDefault = 2 * time.Minute

// StreamConfig describes the engine's stream.
type StreamConfig struct {
	// Name of the stream.
	Name string
	// Subjects the stream captures, such as "idemsaga.>".
	Subjects []string
	// DuplicateWindow for Nats-Msg-Id dedup. Defaults to DuplicateWindowDefault.
	DuplicateWindow time.Duration
}

// EnsureStream creates the stream, or updates it to cfg, idempotently.
// Messages are removed once acknowledged (work-queue retention).
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	if cfg.DuplicateWindow == 0 {
		cfg.DuplicateWindow = DuplicateWindowDefault
	}
	s, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        cfg.Name,
		Description: "idemsaga commands and replies",
		Subjects:    cfg.Subjects,
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		Duplicates:  cfg.DuplicateWindow,
	})
	if err != nil {
		return nil, fmt.Errorf("create JetStream stream %q (is JetStream enabled on the server? start nats-server with -js): %w", cfg.Name, err)
	}
	return s, nil
}

// ConsumerConfig describes one durable pull consumer.
type ConsumerConfig struct {
	Durable string
	Filter  string
	// AckWait is how long the server waits for an ack before redelivering.
	AckWait time.Duration
	// MaxAckPending bounds unacknowledged messages across all processes.
	MaxAckPending int
}

// EnsureConsumer creates or updates a durable pull consumer idempotently.
func EnsureConsumer(ctx context.Context, s jetstream.Stream, cfg ConsumerConfig) (jetstream.Consumer, error) {
	c, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       cfg.Durable,
		FilterSubject: cfg.Filter,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: cfg.MaxAckPending,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return nil, fmt.Errorf("create JetStream consumer %q: %w", cfg.Durable, err)
	}
	return c, nil
}

// HandlerFunc processes one message and acks, naks or terminates it.
// It runs under a context that is not cancelled by Stop, so work in hand
// finishes.
type HandlerFunc func(ctx context.Context, msg jetstream.Msg)

// Pool runs Concurrency handlers on a consumer until its context ends,
// then drains: messages already fetched are handled, none are fetched anew.
func Pool(ctx context.Context, log *slog.Logger, c jetstream.Consumer, concurrency int, handle HandlerFunc) {
	for ctx.Err() == nil {
		err := runPool(ctx, c, concurrency, handle)
		if err == nil || ctx.Err() != nil {
			return
		}
		log.Warn("consumer stopped; restarting", "consumer", c.CachedInfo().Name, "error", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

func runPool(ctx context.Context, c jetstream.Consumer, concurrency int, handle HandlerFunc) error {
	it, err := c.Messages(jetstream.PullMaxMessages(concurrency * 2))
	if err != nil {
		return err
	}
	msgs := make(chan jetstream.Msg)
	var wg sync.WaitGroup
	for range concurrency {
		wg.Go(func() {
			for m := range msgs {
				handle(context.WithoutCancel(ctx), m)
			}
		})
	}
	stop := context.AfterFunc(ctx, it.Drain)
	defer stop()
	var loopErr error
	for {
		m, err := it.Next()
		if err != nil {
			if !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				loopErr = err
				it.Stop()
			}
			break
		}
		msgs <- m
	}
	close(msgs)
	wg.Wait()
	return loopErr
}
