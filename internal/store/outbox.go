package store

// outboxInsert is the engine's one insert into the outbox: every statement
// that writes a command, a reply or a dead letter's resend composes it,
// with rows, a SELECT of (subject, msg_id, payload, saga_id,
// publish_after, headers), and its own RETURNING.
func outboxInsert(rows string) string {
	return "insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after, headers)\n  " + rows
}

// InsertOutbox writes one message: $1 subject, $2 message id, $3 payload,
// $4 saga, $5 hand-off in milliseconds (NULL: the relay's at once), $6
// headers (JSON, NULL for none). It returns the row's id.
var InsertOutbox = outboxInsert(`select $1::text, $2::text, $3::bytea, $4::uuid, clock_timestamp() + $5::bigint * interval '1 millisecond', $6::jsonb`) + ` returning id`
