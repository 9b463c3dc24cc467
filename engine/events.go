package engine

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/events"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// Events start sagas from the messages of a NATS subject
// (saga.WithEvents). Each engine that runs such a definition reads its
// events through one durable consumer, named Config.Stream +
// "_events_" + the definition's name, on the stream that holds the
// subject: the publisher's stream, which the engine never creates or
// changes, since its retention and limits are the publisher's choice and
// JetStream refuses two streams on one subject. An engine started with
// no stream capturing the subject fails, and says what to create. The
// messages that cannot start a saga are kept in
// idemsaga.event_dead_letters (EventDeadLetters).

// EventConcurrencyDefault is Config.EventConcurrency's default.
const EventConcurrencyDefault = events.ConcurrencyDefault

// EventDeadLetter is a message of a definition's events that could not
// start a saga, kept with why. It was acknowledged: it is not delivered
// again. Fix its publisher (or the definition's input rules) and publish
// it again, then drop it.
type EventDeadLetter struct {
	ID         int64  `json:"id"`
	Definition string `json:"definition"`
	// Stream and StreamSeq place the message in its stream.
	Stream    string `json:"stream"`
	StreamSeq uint64 `json:"stream_seq"`
	Subject   string `json:"subject"`
	// Key is the message's key header, "" when it had none.
	Key     string            `json:"key,omitempty"`
	Headers map[string]string `json:"headers,omitempty"`
	// Body is the message's body as it came.
	Body   []byte `json:"body"`
	Reason string `json:"reason"`
	// Deliveries is how many deliveries of the message were seen.
	Deliveries int       `json:"deliveries"`
	ParkedBy   string    `json:"parked_by"`
	At         time.Time `json:"at"`
}

// EventDeadLetterFilter filters Client.EventDeadLetters. Zero fields do
// not filter.
type EventDeadLetterFilter struct {
	// Definition keeps those of one definition.
	Definition string
	// Limit bounds the result. Defaults to 100.
	Limit int
}

// EventDeadLetters returns the event dead letters matching f, oldest
// first.
func (cl *Client) EventDeadLetters(ctx context.Context, f EventDeadLetterFilter) ([]EventDeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := store.EventDeadLetters(ctx, cl.c.DB(), f.Definition, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list event dead letters: %w", err)
	}
	out := make([]EventDeadLetter, len(rows))
	for i, r := range rows {
		out[i] = EventDeadLetter{ID: r.ID, Definition: r.Definition, Stream: r.Stream, StreamSeq: r.StreamSeq, Subject: r.Subject,
			Headers: r.Headers, Body: r.Payload, Reason: r.Reason, Deliveries: r.Deliveries, ParkedBy: r.ParkedBy, At: r.At}
		if r.Key != nil {
			out[i].Key = *r.Key
		}
	}
	return out, nil
}

// DropEventDeadLetters deletes the given event dead letters. An id not in
// the table is ErrDeadLetterNotFound, and nothing is dropped.
func (cl *Client) DropEventDeadLetters(ctx context.Context, ids ...int64) error {
	return cl.inTx(ctx, func(tx pgx.Tx) error { return cl.DropEventDeadLettersTx(ctx, tx, ids...) })
}

// DropEventDeadLettersTx is DropEventDeadLetters in the caller's
// transaction. On an error the caller must roll back.
func (cl *Client) DropEventDeadLettersTx(ctx context.Context, tx pgx.Tx, ids ...int64) error {
	ids = distinct(ids)
	if len(ids) == 0 {
		return fmt.Errorf("%w: give the ids of the event dead letters to drop (`events dead-letters`)", ErrDeadLetterNotFound)
	}
	dropped, err := store.DropEventDeadLetters(ctx, cl.c.Schema().Q(tx), ids)
	if err != nil {
		return fmt.Errorf("idemsaga: drop event dead letters: %w", err)
	}
	if len(dropped) != len(ids) {
		return fmt.Errorf("%w: %d of event dead letters %s are not there (dropped already); nothing was dropped", ErrDeadLetterNotFound, len(ids)-len(dropped), joinIDs(ids))
	}
	return nil
}

// eventStarter starts the sagas of events through the engine's client.
type eventStarter struct{ cl *Client }

func (s eventStarter) Start(ctx context.Context, def *saga.Definition, key string, input any) (bool, error) {
	if IsSubmitToken(key) {
		return false, fmt.Errorf("%w: key %q begins as a submit token does (%q); an event's key must be its own, such as its message id", events.ErrRefused, key, SubmitTokenPrefix)
	}
	res, err := s.cl.Start(ctx, def, key, input)
	return res.Duplicate, err
}
