package engine

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/broker"
)

// stream creates the engine's stream, or brings an existing one to the
// settings Config gives (broker.EnsureStream). A JetStream that does not
// answer in time (a cluster still forming, a stream's leader being
// elected) is tried again, a bounded number of times.
func (e *Engine) stream(ctx context.Context) (jetstream.Stream, error) {
	cfg := broker.StreamConfig{Name: e.cfg.Stream, Owner: e.c.Schema().Name(), Subjects: []string{e.subjects.All()}, Replicas: e.cfg.StreamReplicas,
		MaxAge: e.cfg.StreamMaxAge, DuplicateWindow: e.cfg.StreamDuplicateWindow, Logger: e.cfg.Logger}
	switch e.cfg.StreamStorage {
	case "file":
		st := jetstream.FileStorage
		cfg.Storage = &st
	case "memory":
		st := jetstream.MemoryStorage
		cfg.Storage = &st
	}
	var s jetstream.Stream
	err := e.untilAnswered(ctx, "stream "+cfg.Name, func() (err error) {
		s, err = broker.EnsureStream(ctx, e.js, cfg)
		return err
	})
	return s, err
}

// untilAnswered runs ask until it succeeds, fails for another reason than
// JetStream not being ready (a cluster still forming, a leader being
// elected, a peer still starting), or has been tried streamTries times.
func (e *Engine) untilAnswered(ctx context.Context, what string, ask func() error) error {
	var err error
	for i, delay := 0, 250*time.Millisecond; ; i, delay = i+1, min(2*delay, 4*time.Second) {
		if err = ask(); err == nil {
			return nil
		}
		if !broker.Transient(err) || i >= streamTries-1 || ctx.Err() != nil {
			break
		}
		e.cfg.Logger.Warn("JetStream is not ready (a cluster forming, a leader being elected); trying again", "what", what, "try", i+1, "of", streamTries, "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(delay):
		}
	}
	return fmt.Errorf("idemsaga: %w", err)
}

// streamTries bounds how many times the stream, or a consumer, is looked
// up at start while JetStream does not answer: about 30 seconds.
const streamTries = 10

// The base names of the engine's durable consumers: each definition has
// a consumer of its commands, base_<definition>, and one of its replies,
// so a process is given the messages of the definitions it runs only.
// The consumers an earlier release made, of every definition's messages,
// had the base names alone; they are retired when they stand in the way.
const (
	commandsConsumer = "_steps"
	repliesConsumer  = "_orchestrator"
)

// definitionNames are the names of the definitions the engine runs.
func (e *Engine) definitionNames() []string {
	var names []string
	for _, d := range e.cfg.Definitions {
		if !slices.Contains(names, d.Name()) {
			names = append(names, d.Name())
		}
	}
	return names
}

// commandConsumers are the consumers of the commands of each definition
// the engine runs.
func (e *Engine) commandConsumers() []broker.ConsumerFunc {
	return e.consumerFuncs(commandsConsumer, e.subjects.Commands)
}

// replyConsumers are the consumers of the replies of each definition the
// engine runs.
func (e *Engine) replyConsumers() []broker.ConsumerFunc {
	return e.consumerFuncs(repliesConsumer, e.subjects.Reply)
}

func (e *Engine) consumerFuncs(base string, filter func(definition string) string) []broker.ConsumerFunc {
	var out []broker.ConsumerFunc
	for _, c := range broker.DefinitionConsumers(e.cfg.Stream+base, e.definitionNames(), filter) {
		out = append(out, e.consumerFunc(c, e.cfg.Stream+base))
	}
	return out
}

// consumerFunc returns a function that ensures the stream and one
// definition's durable consumer exist and returns the consumer.
func (e *Engine) consumerFunc(dc broker.DefinitionConsumer, retired string) broker.ConsumerFunc {
	return func(ctx context.Context) (jetstream.Consumer, error) {
		s, err := e.stream(ctx)
		if err != nil {
			return nil, err
		}
		// A consumer's lookup waits out a forming cluster as the stream's
		// does.
		var c jetstream.Consumer
		err = e.untilAnswered(ctx, "consumer "+dc.Durable, func() (err error) {
			c, err = broker.EnsureDefinitionConsumer(ctx, s, broker.ConsumerConfig{
				Durable: dc.Durable, Filter: dc.Filter, AckWait: e.cfg.AckWait, MaxAckPending: 10000,
			}, retired, e.cfg.Logger)
			return err
		})
		if err != nil {
			return nil, err
		}
		return c, nil
	}
}
