package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements of the event dead letters: messages of a definition's
// events (saga.WithEvents) that could not start a saga.

// parkEvent records a message that could not start a saga, once per
// message of its stream: a delivery again of one recorded already
// (its ack lost) counts its delivery and keeps the first reason.
const parkEvent = `insert into idemsaga.event_dead_letters (definition, stream, stream_seq, subject, event_key, headers, payload, reason, deliveries, parked_by)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
on conflict (definition, stream, stream_seq) do update set deliveries = greatest(event_dead_letters.deliveries, excluded.deliveries)
returning id`

// listEventDeadLetters filters by definition ($1, ” for all), oldest
// first, at most $2.
const listEventDeadLetters = `select id, definition, stream, stream_seq, subject, event_key, headers, payload, reason, deliveries, parked_by, created_at
from idemsaga.event_dead_letters where ($1 = '' or definition = $1) order by id limit $2`

// dropEventDeadLetters deletes event dead letters by id ($1), returning
// those it deleted.
const dropEventDeadLetters = `delete from idemsaga.event_dead_letters where id = any($1) returning id`

// EventDeadLetter is a row of idemsaga.event_dead_letters.
type EventDeadLetter struct {
	ID         int64
	Definition string
	Stream     string
	StreamSeq  uint64
	Subject    string
	// Key is the message's key header, nil when it had none.
	Key        *string
	Headers    map[string]string
	Payload    []byte
	Reason     string
	Deliveries int
	ParkedBy   string
	At         time.Time
}

// ParkEvent records a message of definition's events that could not start
// a saga, and returns its row's id.
func ParkEvent(ctx context.Context, q Querier, e EventDeadLetter) (int64, error) {
	var id int64
	err := q.QueryRow(ctx, parkEvent, e.Definition, e.Stream, int64(e.StreamSeq), e.Subject, e.Key, HeadersJSON(e.Headers), e.Payload,
		e.Reason, max(e.Deliveries, 1), e.ParkedBy).Scan(&id)
	return id, Interpret(err)
}

// EventDeadLetters lists the event dead letters of definition ("" for
// all), oldest first, at most limit.
func EventDeadLetters(ctx context.Context, q Queryer, definition string, limit int) ([]EventDeadLetter, error) {
	rows, err := q.Query(ctx, listEventDeadLetters, definition, limit)
	if err != nil {
		return nil, Interpret(err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (EventDeadLetter, error) {
		var e EventDeadLetter
		var seq int64
		err := row.Scan(&e.ID, &e.Definition, &e.Stream, &seq, &e.Subject, &e.Key, &e.Headers, &e.Payload, &e.Reason, &e.Deliveries, &e.ParkedBy, &e.At)
		e.StreamSeq = uint64(seq)
		return e, err
	})
}

// DropEventDeadLetters deletes the event dead letters ids, and returns
// those it deleted.
func DropEventDeadLetters(ctx context.Context, q Queryer, ids []int64) ([]int64, error) {
	rows, err := q.Query(ctx, dropEventDeadLetters, ids)
	if err != nil {
		return nil, Interpret(err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}
