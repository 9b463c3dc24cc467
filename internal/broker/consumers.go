package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// Server error codes of a consumer refused on a work-queue stream because
// its filter overlaps another consumer's (or it has none).
const (
	codeWQFilterNotUnique    jetstream.ErrorCode = 10100
	codeWQMultipleUnfiltered jetstream.ErrorCode = 10099
)

// overlaps reports whether err is JetStream refusing a consumer whose
// filter overlaps another consumer's on a work-queue stream.
func overlaps(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && (api.ErrorCode == codeWQFilterNotUnique || api.ErrorCode == codeWQMultipleUnfiltered)
}

// DefinitionConsumer is the durable consumer of one saga definition's
// commands or replies. Each definition has its own, so that a process
// is given only the messages of definitions it runs: two services with
// different definitions on one stream never receive each other's.
type DefinitionConsumer struct {
	// Durable is the consumer's name: the base name, '_' and the
	// definition.
	Durable string
	// Filter is the definition's subjects.
	Filter string
}

// DefinitionConsumers are the consumers of definitions (names, each once)
// named base_<definition>, each filtering the subjects filter gives it.
func DefinitionConsumers(base string, definitions []string, filter func(definition string) string) []DefinitionConsumer {
	var out []DefinitionConsumer
	for _, d := range definitions {
		if slices.ContainsFunc(out, func(c DefinitionConsumer) bool { return c.Durable == base+"_"+d }) {
			continue
		}
		out = append(out, DefinitionConsumer{Durable: base + "_" + d, Filter: filter(d)})
	}
	return out
}

// Retire deletes the consumer named retired when creating one that
// overlaps it is refused: a consumer of every definition's subjects, as
// an engine of an earlier release made, or as one still running makes
// again. Its messages stay in the stream for the consumers of their
// definitions. It returns whether it deleted one.
func Retire(ctx context.Context, s jetstream.Stream, retired string, log *slog.Logger) (bool, error) {
	err := s.DeleteConsumer(ctx, retired)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("delete JetStream consumer %q, which takes every definition's messages: %w", retired, err)
	}
	log.Warn("deleted the JetStream consumer of every definition's messages: each definition now has a consumer of its own. A process of an earlier release still running takes no message from the stream: upgrade it",
		"stream", s.CachedInfo().Config.Name, "consumer", retired)
	return true, nil
}

// EnsureDefinitionConsumer is EnsureConsumer for a definition's consumer
// that retires the consumer named retired when it stands in the way.
func EnsureDefinitionConsumer(ctx context.Context, s jetstream.Stream, cfg ConsumerConfig, retired string, log *slog.Logger) (jetstream.Consumer, error) {
	c, err := EnsureConsumer(ctx, s, cfg)
	if err == nil || !overlaps(err) || retired == "" {
		return c, err
	}
	if _, rerr := Retire(ctx, s, retired, log); rerr != nil {
		return nil, errors.Join(err, rerr)
	}
	return EnsureConsumer(ctx, s, cfg)
}

// Pools runs a Pool on each consumer, each with concurrency handlers,
// until ctx ends and every one has drained.
func Pools(ctx, work context.Context, log *slog.Logger, consumers []ConsumerFunc, concurrency int, handle HandlerFunc) {
	var wg sync.WaitGroup
	for _, c := range consumers {
		wg.Go(func() { Pool(ctx, work, log, c, concurrency, handle) })
	}
	wg.Wait()
}
