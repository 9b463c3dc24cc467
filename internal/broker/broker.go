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
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
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

// StreamConfig describes the engine's stream. The settings are the
// user's: a zero one takes its default for a new stream and leaves an
// existing stream's own value alone, so that a stream an operator made
// (three replicas, a max age) is never rewritten behind their back.
type StreamConfig struct {
	// Name of the stream.
	Name string
	// Subjects the stream captures, such as "idemsaga.>".
	Subjects []string
	// Replicas is the stream's replica count, 1 to 5 (a JetStream
	// cluster's nodes). Defaults to 1 for a new stream.
	Replicas int
	// Storage is jetstream.FileStorage or jetstream.MemoryStorage; it
	// cannot change once the stream exists. Defaults to file for a new
	// stream.
	Storage *jetstream.StorageType
	// MaxAge, if set, drops messages older than it (a command older than
	// its lease is driven again from PostgreSQL anyway). Defaults to none
	// for a new stream.
	MaxAge time.Duration
	// DuplicateWindow for Nats-Msg-Id dedup. Defaults to
	// DuplicateWindowDefault for a new stream.
	DuplicateWindow time.Duration
	// Owner is the PostgreSQL schema of the deployment the stream serves,
	// kept in the stream's metadata: a stream of another deployment is
	// refused (its commands would name sagas this one does not have), and
	// a stream without one is given this one. Empty: not checked.
	Owner string
	// Logger receives what EnsureStream changed on an existing stream.
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// ownerKey is the stream metadata key of StreamConfig.Owner.
const ownerKey = "idemsaga_schema"

// EnsureStream returns the stream, creating it when missing. An existing
// stream is updated only for a setting given in cfg that differs from it,
// and each change is logged (old and new value); settings cfg leaves zero
// keep the stream's own. A stream that cannot serve the engine (not a
// work queue, another storage than asked) is an error that says what to
// do; nothing is changed then. It is called at every consumer (re)start,
// and needless updates race with consumer creation on the server.
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg StreamConfig) (jetstream.Stream, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	want := jetstream.StreamConfig{
		Name:        cfg.Name,
		Description: "idemsaga commands and replies",
		Subjects:    cfg.Subjects,
		Retention:   jetstream.WorkQueuePolicy,
		Storage:     jetstream.FileStorage,
		Replicas:    max(cfg.Replicas, 1),
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.DuplicateWindow,
	}
	if cfg.Storage != nil {
		want.Storage = *cfg.Storage
	}
	if cfg.Owner != "" {
		want.Metadata = map[string]string{ownerKey: cfg.Owner}
	}
	if want.Duplicates == 0 {
		// The default window, or the max age when that is shorter:
		// JetStream refuses a window longer than the max age.
		want.Duplicates = DuplicateWindowDefault
		if want.MaxAge > 0 && want.MaxAge < want.Duplicates {
			want.Duplicates = want.MaxAge
		}
	}
	s, err := js.Stream(ctx, cfg.Name)
	switch {
	case err == nil:
		have := s.CachedInfo().Config
		update, changes, err := reconcileStream(have, cfg)
		if err != nil {
			return nil, err
		}
		if len(changes) == 0 {
			return s, nil
		}
		s, err = js.UpdateStream(ctx, update)
		if err != nil {
			return nil, fmt.Errorf("update JetStream stream %q (%s): %w; %s", cfg.Name, strings.Join(changes, ", "), err, Hint(err))
		}
		log.Warn("JetStream stream updated to this process's settings", "stream", cfg.Name, "changes", strings.Join(changes, ", "))
		return s, nil
	case errors.Is(err, jetstream.ErrStreamNotFound):
		s, err = js.CreateStream(ctx, want)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = js.Stream(ctx, cfg.Name) // another process created it
		} else if err == nil && want.Replicas == 1 {
			if cluster := js.Conn().ConnectedClusterName(); cluster != "" {
				log.Warn("JetStream stream created with one replica on a clustered server: losing the node that holds it halts every saga until it returns; give --stream-replicas 3 (Config.StreamReplicas) to keep it on three nodes",
					"stream", cfg.Name, "cluster", cluster)
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("create JetStream stream %q: %w; %s", cfg.Name, err, Hint(err))
	}
	return s, nil
}

// reconcileStream returns the update that brings an existing stream to
// the settings cfg gives, starting from the stream's own configuration,
// and what it changes; or why the stream cannot serve the engine.
func reconcileStream(have jetstream.StreamConfig, cfg StreamConfig) (jetstream.StreamConfig, []string, error) {
	if have.Retention != jetstream.WorkQueuePolicy {
		return have, nil, fmt.Errorf("JetStream stream %q has %s retention; the engine needs a work queue (messages removed once acknowledged): give another --stream name, or delete that stream", have.Name, have.Retention)
	}
	if cfg.Storage != nil && have.Storage != *cfg.Storage {
		return have, nil, fmt.Errorf("JetStream stream %q has %s storage and %s was asked for; storage cannot change: ask for %s, or move to a new --stream name", have.Name, have.Storage, *cfg.Storage, have.Storage)
	}
	update := have
	var changes []string
	switch owner := have.Metadata[ownerKey]; {
	case cfg.Owner == "" || owner == cfg.Owner:
	case owner != "":
		return have, nil, fmt.Errorf("JetStream stream %q serves the deployment of PostgreSQL schema %q, and this one's is %q: two deployments cannot share a stream (each would be given commands for sagas it does not have); give this one its own --stream and --subject-prefix (Config.Stream, Config.SubjectPrefix)",
			have.Name, owner, cfg.Owner)
	default:
		changes = append(changes, fmt.Sprintf("owner schema -> %s", cfg.Owner))
		update.Metadata = maps.Clone(have.Metadata)
		if update.Metadata == nil {
			update.Metadata = map[string]string{}
		}
		update.Metadata[ownerKey] = cfg.Owner
	}
	if !slices.Equal(have.Subjects, cfg.Subjects) {
		changes = append(changes, fmt.Sprintf("subjects %v -> %v", have.Subjects, cfg.Subjects))
		update.Subjects = cfg.Subjects
	}
	if cfg.Replicas != 0 && have.Replicas != cfg.Replicas {
		changes = append(changes, fmt.Sprintf("replicas %d -> %d", have.Replicas, cfg.Replicas))
		update.Replicas = cfg.Replicas
	}
	if cfg.MaxAge != 0 && have.MaxAge != cfg.MaxAge {
		changes = append(changes, fmt.Sprintf("max age %s -> %s", have.MaxAge, cfg.MaxAge))
		update.MaxAge = cfg.MaxAge
	}
	if cfg.DuplicateWindow != 0 && have.Duplicates != cfg.DuplicateWindow {
		changes = append(changes, fmt.Sprintf("duplicate window %s -> %s", have.Duplicates, cfg.DuplicateWindow))
		update.Duplicates = cfg.DuplicateWindow
	}
	if update.MaxAge > 0 && update.Duplicates > update.MaxAge {
		return have, nil, fmt.Errorf("JetStream stream %q would keep messages %s (--stream-max-age, Config.StreamMaxAge) under a duplicate window of %s (--stream-duplicate-window, Config.StreamDuplicateWindow), and JetStream refuses a window longer than the max age: give a window of at most %s, or a max age of at least %s",
			have.Name, update.MaxAge, update.Duplicates, update.MaxAge, update.Duplicates)
	}
	return update, changes, nil
}

// Transient reports whether err is JetStream not ready yet (a cluster
// forming, a leader being elected, a peer of the stream's still
// starting), worth trying again.
func Transient(err error) bool {
	msg := strings.ToLower(err.Error())
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		strings.Contains(msg, "stream offline") || strings.Contains(msg, "no leader") || strings.Contains(msg, "cluster not ready") ||
		strings.Contains(msg, "peer offline") || strings.Contains(msg, "temporarily unavailable")
}

// Hint says what to do about an error from JetStream's API: JetStream
// not enabled, not authorised, or a stream whose replicas cannot be
// reached or placed.
func Hint(err error) string {
	msg := strings.ToLower(err.Error())
	switch {
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount),
		errors.Is(err, nats.ErrNoResponders):
		return "JetStream is not enabled on this server or account: start nats-server with -js (or enable JetStream for the account)"
	case errors.Is(err, nats.ErrPermissionViolation), errors.Is(err, nats.ErrAuthorization), strings.Contains(msg, "permission"), strings.Contains(msg, "authorization"):
		return "this user is not allowed to use JetStream's API: grant it publish and subscribe on $JS.API.> and the stream's subjects"
	case strings.Contains(msg, "insufficient resources"), strings.Contains(msg, "no suitable peers"), strings.Contains(msg, "replicas > 1 not supported"):
		return "the cluster cannot place the stream's replicas: give --stream-replicas at most the JetStream nodes that run, or start the missing ones"
	case errors.Is(err, nats.ErrTimeout), errors.Is(err, context.DeadlineExceeded), strings.Contains(msg, "stream offline"), strings.Contains(msg, "no leader"),
		strings.Contains(msg, "temporarily unavailable"), strings.Contains(msg, "peer offline"):
		return "JetStream did not answer in time: the cluster may be forming or the stream's replicas down; start the nodes that hold it, and this process retries"
	}
	return "check NATS_URL and the server's log"
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
// messages already fetched are handled, none are fetched anew. Handlers run
// under work, which outlives ctx: cancelling it cancels the work in hand.
// When the consumer stops for any other reason (the connection closed, the
// consumer was deleted), Pool gets the consumer again and resumes; it never
// gives up while ctx lives.
func Pool(ctx, work context.Context, log *slog.Logger, consumer ConsumerFunc, concurrency int, handle HandlerFunc) {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		c, err := consumer(ctx)
		if err == nil {
			began := time.Now()
			err = runPool(ctx, work, c, concurrency, handle)
			if err == nil || time.Since(began) > 10*time.Second {
				// It ran: a later loss (the next failover) resumes
				// quickly again.
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
func runPool(ctx, work context.Context, c jetstream.Consumer, concurrency int, handle HandlerFunc) error {
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
				handle(work, m)
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
