package attempt

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// Defaults of DeadLetterPolicy: five deliveries over about four minutes
// (waits of 10s, 30s, 90s and 120s), long enough for a rolling deploy's
// new workers to come up and take a command the old ones do not know.
const (
	DeadLetterDeliveriesDefault = 5
	DeadLetterBackoffDefault    = 10 * time.Second
	DeadLetterMaxBackoffDefault = 2 * time.Minute
)

// DeadLetterPolicy bounds the deliveries of a command a worker cannot run
// before it parks it in idemsaga.dead_letters.
type DeadLetterPolicy struct {
	// Deliveries is how many deliveries a command may have before it is
	// parked. Defaults to DeadLetterDeliveriesDefault.
	Deliveries int
	// Backoff is the wait before the second delivery; each next wait is
	// three times longer, up to MaxBackoff. Default to
	// DeadLetterBackoffDefault and DeadLetterMaxBackoffDefault.
	Backoff, MaxBackoff time.Duration
}

func (p DeadLetterPolicy) withDefaults() DeadLetterPolicy {
	if p.Deliveries <= 0 {
		p.Deliveries = DeadLetterDeliveriesDefault
	}
	if p.Backoff <= 0 {
		p.Backoff = DeadLetterBackoffDefault
	}
	if p.MaxBackoff <= 0 {
		p.MaxBackoff = max(DeadLetterMaxBackoffDefault, p.Backoff)
	}
	return p
}

// delay is the wait after the delivered-th delivery.
func (p DeadLetterPolicy) delay(delivered int) time.Duration {
	d := p.Backoff
	for i := 1; i < delivered && d < p.MaxBackoff; i++ {
		d *= 3
	}
	return min(d, p.MaxBackoff)
}

// UnknownError is a command this runner cannot run: its definition, its
// definition's version or its step is not one the runner has. It wraps
// saga.ErrUnknownDefinition.
type UnknownError struct {
	// Reason says what is unknown, for logs and the dead-letter table.
	Reason string
}

func (e *UnknownError) Error() string { return "idemsaga: " + e.Reason }

// Unwrap lets errors.Is(err, saga.ErrUnknownDefinition) match.
func (e *UnknownError) Unwrap() error { return saga.ErrUnknownDefinition }

// lookup returns the definition version and the step a command names, or
// an *UnknownError.
func (r *Runner) lookup(cmd wire.Command) (*saga.Definition, int, error) {
	ref := saga.Ref(cmd.Definition, cmd.DefVersion())
	def, ok := r.defs[ref]
	if !ok {
		versions, known := r.names[cmd.Definition]
		if !known {
			return nil, 0, &UnknownError{Reason: fmt.Sprintf("this worker does not run definition %q", cmd.Definition)}
		}
		vs := make([]string, len(versions))
		for i, v := range slices.Sorted(slices.Values(versions)) {
			vs[i] = fmt.Sprint(v)
		}
		return nil, 0, &UnknownError{Reason: fmt.Sprintf("this worker runs definition %q at version %s, not %d", cmd.Definition, strings.Join(vs, ", "), cmd.DefVersion())}
	}
	idx := def.StepIndex(cmd.Step)
	if idx < 0 {
		return nil, 0, &UnknownError{Reason: fmt.Sprintf("definition %s has no step %q here", ref, cmd.Step)}
	}
	return def, idx, nil
}

// sagaFinishedOrGone tells whether a command's saga finished or is gone:
// then nobody needs the command.
const sagaFinishedOrGone = `select coalesce((select finished_at is not null from idemsaga.sagas where id = $1), true)`

// unknownCommand handles a delivery of a command this runner cannot run.
// A command whose saga finished or is gone is dropped: nobody needs it.
// Otherwise it goes back to the broker, for a worker that runs it, after
// a wait that grows with each delivery; once it was delivered
// DeadLetterPolicy.Deliveries times it is parked in the dead-letter table
// and acknowledged, and a worker that runs its version sends it again
// when it runs.
func (r *Runner) unknownCommand(ctx context.Context, msg jetstream.Msg, cmd wire.Command, reason string) {
	log := r.cfg.Logger.With("saga_id", cmd.SagaID, "definition", cmd.Definition, "definition_version", cmd.DefVersion(), "step", cmd.Step, "phase", cmd.Phase, "attempt", cmd.Attempt)
	var finished bool
	err := r.db().QueryRow(ctx, sagaFinishedOrGone, pguuid.Of(cmd.SagaID)).Scan(&finished)
	if err == nil && finished {
		log.Info("step worker: dropping a command this worker cannot run, whose saga finished or is gone", "reason", reason)
		_ = msg.Term()
		return
	}
	delivered := 1
	md, mdErr := msg.Metadata()
	if mdErr == nil {
		delivered = int(md.NumDelivered)
	}
	if err != nil || delivered < r.dead.Deliveries {
		delay := r.dead.delay(delivered)
		lvl := log.Debug
		if delivered == 1 {
			lvl = log.Warn
		}
		lvl("step worker: a command this worker cannot run; left to a worker that runs it (start one, or check `workers`)",
			"reason", reason, "delivery", delivered, "parked_after", r.dead.Deliveries, "retry_in", delay)
		r.cfg.Metrics.CommandsHandedBack.WithLabelValues(cmd.Definition).Inc()
		_ = msg.NakWithDelay(delay)
		return
	}
	first := time.Now()
	if mdErr == nil {
		first = md.Timestamp
	}
	var id int64
	err = r.db().QueryRow(ctx, store.ParkCommand, messageID(msg), msg.Subject(), msg.Data(), headersOf(msg), pguuid.Of(cmd.SagaID),
		cmd.Definition, cmd.DefVersion(), cmd.Step, string(cmd.Phase), cmd.Attempt, reason, delivered, parkedBy(), first).Scan(&id)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		// Parked already (a delivery whose ack was lost), or its saga
		// went meanwhile.
	case err != nil:
		log.Warn("step worker: could not park a command this worker cannot run; it will be delivered again", "reason", reason, "error", err)
		_ = msg.NakWithDelay(r.dead.delay(delivered))
		return
	default:
		r.cfg.Metrics.DeadLettersParked.WithLabelValues(cmd.Definition).Inc()
		log.Warn("step worker: parked a command no worker that received it could run; a worker that runs its version sends it again when it runs, or see `dead-letters list`",
			"reason", reason, "deliveries", delivered, "dead_letter", id)
	}
	_ = msg.Ack()
}

// messageID is the broker's id of msg: its Nats-Msg-Id, or the stream's
// sequence when it has none.
func messageID(msg jetstream.Msg) string {
	if id := msg.Headers().Get(jetstream.MsgIDHeader); id != "" {
		return id
	}
	if md, err := msg.Metadata(); err == nil {
		return fmt.Sprintf("seq-%s-%d", md.Stream, md.Sequence.Stream)
	}
	return fmt.Sprintf("unknown-%d", time.Now().UnixNano())
}

// headersOf returns msg's own headers, without the broker's (Nats-*), as
// the outbox stores them; nil when there are none.
func headersOf(msg jetstream.Msg) []byte {
	h := map[string]string{}
	for k, v := range msg.Headers() {
		if !strings.HasPrefix(k, "Nats-") && len(v) > 0 {
			h[k] = v[0]
		}
	}
	if len(h) == 0 {
		return nil
	}
	b, _ := json.Marshal(h)
	return b
}

func parkedBy() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s pid %d", host, os.Getpid())
}
