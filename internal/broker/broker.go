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
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// DuplicateWindowDefault is the stream's Nats-Msg-Id dedup window. It is a
// fast path only; the inbox and fenced updates are the guarantee.
const DuplicateWindowDefault = 2 * time.Minute

// Pull request settings of every consumer: how long one pull waits on the
// server, and how often the server proves it is alive meanwhile.
const (
	PullExpiry    = 5 * time.Second
	PullHeartbeat = time.Second
)

// StreamConfig describes the engine's stream.
type StreamConfig struct {
	// Name of the stream.
	Name string
	// Subjects the stream captures, such as "idemsaga.>".
	Subjects []string
	// DuplicateWindow for Nats-Msg-Id dedup. Defaults to DuplicateWindowDefault.
	DuplicateWindow time.Duration
}

// EnsureStream returns the stream, creating it when missing and updating it
// only when its configuration differs: it is called at every consumer
// (re)start, and needless updates race with consumer creation on the server.
// Messages are removed once acknowledged (work-queue retention).
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	if cfg.DuplicateWindow == 0 {
		cfg.DuplicateWindow = DuplicateWindowDefault
	}
	want := jetstream.StreamConfig{
		Name:        cfg.Name,
		Description: "idemsaga commands and replies",
		Subjects:    cfg.Subjects,
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		Duplicates:  cfg.DuplicateWindow,
	}
	s, err := js.Stream(ctx, cfg.Name)
	switch {
	case err == nil:
		have := s.CachedInfo().Config
		if slices.Equal(have.Subjects, want.Subjects) && have.Retention == want.Retention && have.Duplicates == want.Duplicates {
			return s, nil
		}
		s, err = js.UpdateStream(ctx, want)
	case errors.Is(err, jetstream.ErrStreamNotFound):
		s, err = js.CreateStream(ctx, want)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = js.Stream(ctx, cfg.Name) // another process created it
		}
	}
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

// EnsureConsumer returns the durable pull consumer, creating it when
// missing and updating it only when its configuration differs.
func EnsureConsumer(ctx context.Context, s jetstream.Stream, cfg ConsumerConfig) (jetstream.Consumer, error) {
	want := jetstream.ConsumerConfig{
		Durable:       cfg.Durable,
		FilterSubject: cfg.Filter,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: cfg.MaxAckPending,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	c, err := s.Consumer(ctx, cfg.Durable)
	if err == nil {
		have := c.CachedInfo().Config
		if have.FilterSubject == want.FilterSubject && have.AckWait == want.AckWait && have.MaxAckPending == want.MaxAckPending {
			return c, nil
		}
	}
	if err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, fmt.Errorf("look up JetStream consumer %q: %w", cfg.Durable, err)
	}
	c, err = s.CreateOrUpdateConsumer(ctx, want)
	if err != nil {
		return nil, fmt.Errorf("create JetStream consumer %q: %w", cfg.Durable, err)
	}
	return c, nil
}

// HandlerFunc processes one message and acks, naks or terminates it.
// It runs under a context that is not cancelled by Stop, so work in hand
// finishes.
type HandlerFunc func(ctx context.Context, msg jetstream.Msg)

// ConsumerFunc returns the consumer to read, creating the stream and the
// consumer again when the server lost them. Pool calls it at every start
// and restart.
type ConsumerFunc func(ctx context.Context) (jetstream.Consumer, error)

// Pool runs concurrency handlers on a consumer until ctx ends, then drains:
// messages already fetched are handled, none are fetched anew. When the
// consumer stops for any other reason (the connection closed, the consumer
// was deleted), Pool gets the consumer again and resumes; it never gives up
// while ctx lives.
func Pool(ctx context.Context, log *slog.Logger, consumer ConsumerFunc, concurrency int, handle HandlerFunc) {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		c, err := consumer(ctx)
		if err == nil {
			err = runPool(ctx, c, concurrency, handle)
			if err == nil {
				delay = 100 * time.Millisecond
			}
		}
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			err = errors.New("message iterator closed")
		}
		log.Warn("consumer stopped; resuming", "error", err, "in", delay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// runPool consumes until the iterator closes. It returns nil when it
// closed because ctx ended, or the error that closed it.
func runPool(ctx context.Context, c jetstream.Consumer, concurrency int, handle HandlerFunc) error {
	// Short pull expiry and heartbeats: a consumer the server lost (a
	// restart without storage) shows up as missing heartbeats within
	// seconds, and Pool recreates it.
	it, err := c.Messages(jetstream.PullMaxMessages(concurrency*2),
		jetstream.PullExpiry(PullExpiry), jetstream.PullHeartbeat(PullHeartbeat),
		jetstream.WithMessagesErrOnMissingHeartbeat(true))
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
	// A consumer deleted on the server does not always end the iterator
	// (its pulls just go unanswered): check it exists every pull expiry,
	// and stop the iterator when it does not, so the caller recreates it.
	watchCtx, endWatch := context.WithCancel(ctx)
	defer endWatch()
	go func() {
		t := time.NewTicker(PullExpiry)
		defer t.Stop()
		for {
			select {
			case <-watchCtx.Done():
				return
			case <-t.C:
			}
			ictx, cancel := context.WithTimeout(watchCtx, PullExpiry)
			_, err := c.Info(ictx)
			cancel()
			if errors.Is(err, jetstream.ErrConsumerNotFound) {
				it.Stop()
				return
			}
		}
	}()
	var loopErr error
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() == nil {
				// Not our Stop: the connection closed or the consumer
				// went away. Report it so the caller resumes.
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
