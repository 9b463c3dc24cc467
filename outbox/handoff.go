package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of the hand-off.
const (
	// HandOffDefault is how long the relay's sweep leaves a row to the
	// process that committed it and publishes it itself (Relay.Publish).
	// It is longer than a broker ack and a settle take, and short enough
	// that a crash between a commit and its publish delays the row only
	// this long.
	HandOffDefault = 10 * time.Second
	// SettleIntervalDefault is how long rows acknowledged after Publish
	// wait to be deleted together.
	SettleIntervalDefault = 50 * time.Millisecond
	// publishPendingMax is how many publishes may await the broker's ack
	// before Publish leaves new rows to the sweep rather than wait.
	publishPendingMax = 1024
)

// Committed is an outbox row whose transaction has committed, for its
// writer to hand to Relay.Publish.
type Committed struct {
	// ID is the row's id in the outbox.
	ID int64
	// Subject, MsgID, Payload and Headers are the row's message.
	Subject string
	MsgID   string
	Payload []byte
	Headers map[string]string
}

// inflight is a row published by Publish whose ack is awaited.
type inflight struct {
	id  int64
	fut jetstream.PubAckFuture
	at  time.Time
}

// handOff holds what Publish sent and the settle loop has not yet
// deleted.
type handOff struct {
	mu      sync.Mutex
	pending []inflight
	wake    chan struct{} // something is pending
	full    chan struct{} // a batch is pending
}

func newHandOff() *handOff {
	return &handOff{wake: make(chan struct{}, 1), full: make(chan struct{}, 1)}
}

func (h *handOff) add(f inflight, batch int) {
	h.mu.Lock()
	h.pending = append(h.pending, f)
	n := len(h.pending)
	h.mu.Unlock()
	if n == 1 {
		signal(h.wake)
	}
	if n == batch {
		signal(h.full)
	}
}

func (h *handOff) take() []inflight {
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.pending
	h.pending = nil
	return p
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Publish publishes rows whose transaction has committed, without waiting
// for the broker. The rows it acknowledges are deleted (or marked, with
// KeepPublished) together, once per SettleInterval or BatchSize rows: one
// statement for the lot, and no claim. A row the broker refuses or does not
// acknowledge stays in the outbox, and the sweep publishes it once its
// hand-off has passed. On a relay that is not running, or while the broker
// is disconnected or has publishPendingMax acks outstanding, Publish does
// nothing, and the sweep takes the rows over in the same way.
func (r *Relay) Publish(rows ...Committed) {
	if len(rows) == 0 || !r.runner.Running() {
		return
	}
	// A broker that is away or behind is not waited for (the publisher
	// would stall the committing goroutine): the sweep takes these rows
	// over after their hand-off.
	if nc := r.cfg.JetStream.Conn(); (nc != nil && !nc.IsConnected()) || r.cfg.JetStream.PublishAsyncPending() >= publishPendingMax {
		r.cfg.Logger.Debug("outbox: broker away or behind; rows left to the relay's sweep", "rows", len(rows))
		return
	}
	for _, c := range rows {
		msg := newMsg(c.Subject, c.Payload, c.Headers)
		// The span covers the send; the broker's ack is settled later.
		sp := r.tracer.StartPublish(msg, c.MsgID, "after_commit")
		fut, err := r.cfg.JetStream.PublishMsgAsync(msg, jetstream.WithMsgID(c.MsgID))
		if err != nil {
			sp.End("failed", err)
			r.cfg.Logger.Debug("outbox: publish after commit failed; the relay publishes the row after its hand-off", "id", c.ID, "error", err)
			continue
		}
		sp.End("sent", nil)
		r.handOff.add(inflight{id: c.ID, fut: fut, at: time.Now()}, r.cfg.BatchSize)
	}
}

func newMsg(subject string, payload []byte, headers map[string]string) *nats.Msg {
	msg := nats.NewMsg(subject)
	msg.Data = payload
	for k, v := range headers {
		msg.Header.Set(k, v)
	}
	return msg
}

// settleLoop deletes what the broker acknowledged after Publish, in
// batches, until the relay stops; then it settles what is left.
func (r *Relay) settleLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			r.settle()
			return
		case <-r.handOff.wake:
		}
		t := time.NewTimer(r.cfg.SettleInterval)
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-r.handOff.full:
		}
		t.Stop()
		r.settle()
	}
}

// settle waits for the acks of what is pending and deletes (or marks) the
// acknowledged rows in one statement.
func (r *Relay) settle() {
	batch := r.handOff.take()
	if len(batch) == 0 {
		return
	}
	ids := make([]int64, 0, len(batch))
	dups, failed := 0, 0
	var firstErr error
	missingStream := false
	for _, f := range batch {
		ack, err := awaitAck(f, r.cfg.PublishTimeout)
		if err != nil {
			failed++
			if firstErr == nil {
				firstErr = err
			}
			if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
				missingStream = true
			}
			continue
		}
		ids = append(ids, f.id)
		if ack != nil && ack.Duplicate {
			dups++
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.PublishTimeout)
	defer cancel()
	if failed > 0 {
		r.cfg.Logger.Warn("outbox: the broker did not acknowledge rows published after commit; the relay publishes them again after their hand-off",
			"rows", failed, "first_error", firstErr)
		if missingStream && r.cfg.RecoverFunc != nil {
			if err := r.cfg.RecoverFunc(ctx); err != nil {
				r.cfg.Logger.Warn("outbox relay: recreate the stream", "error", err)
			}
		}
	}
	if len(ids) == 0 {
		return
	}
	sql := settleDelete
	if r.cfg.KeepPublished {
		sql = settleMark
	}
	tag, err := r.schema.Q(r.cfg.Pool).Exec(ctx, sql, ids)
	if err != nil {
		// Published but still in the outbox: the sweep publishes them
		// again after their hand-off, and the broker's dedup window or the
		// consumers' inbox absorbs the copies.
		r.cfg.Logger.Warn("outbox: could not delete rows the broker acknowledged; they will be published again", "rows", len(ids), "error", err)
		return
	}
	// Rows a sweep took over are its to count.
	if n := int(tag.RowsAffected()); n > 0 && r.cfg.OnPublishFunc != nil {
		r.cfg.OnPublishFunc(n, min(dups, n), time.Since(batch[0].at))
	}
}

// awaitAck waits for one publish's ack, at most until timeout after it was
// sent.
func awaitAck(f inflight, timeout time.Duration) (*jetstream.PubAck, error) {
	select {
	case ack := <-f.fut.Ok():
		return ack, nil
	case err := <-f.fut.Err():
		return nil, err
	default:
	}
	t := time.NewTimer(time.Until(f.at.Add(timeout)))
	defer t.Stop()
	select {
	case ack := <-f.fut.Ok():
		return ack, nil
	case err := <-f.fut.Err():
		return nil, err
	case <-t.C:
		return nil, fmt.Errorf("no ack from the broker within %s", timeout)
	}
}
