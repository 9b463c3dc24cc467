package outbox

import (
	"fmt"
	"maps"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
)

// The tests write rows as a writer that publishes them itself does (the
// engine writes its own, through its writer's statements).
const insertHandedOff = `insert into idemsaga.outbox (subject, msg_id, payload, headers, saga_id, publish_after)
values ($1, $2, $3, $4, $5, clock_timestamp() + $6 * interval '1 millisecond') returning id`

// QueueHandedOff adds the insert of m to b, for a writer that publishes the
// row itself once the transaction running b commits (Relay.Publish). The
// relay's sweep takes the row over only after handOff, if it is still
// there. done receives the row when b runs; hand it to Publish after the
// commit, never before: an uncommitted row must not reach the broker.
func QueueHandedOff(b *pgx.Batch, m Message, handOff time.Duration, done func(Committed)) error {
	h, err := m.encodedHeaders(0)
	if err != nil {
		return err
	}
	if handOff <= 0 {
		return fmt.Errorf("outbox: hand-off of message %s is %s; give a positive duration, such as HandOffDefault", m.MsgID, handOff)
	}
	b.Queue(insertHandedOff, m.Subject, m.MsgID, m.Payload, h, pguuid.OrNull(m.SagaID), handOff.Milliseconds()).QueryRow(func(row pgx.Row) error {
		var id int64
		if err := row.Scan(&id); err != nil {
			return fmt.Errorf("outbox: insert %s: %w", m.MsgID, err)
		}
		done(Committed{ID: id, Subject: m.Subject, MsgID: m.MsgID, Payload: m.Payload, Headers: maps.Clone(m.Headers)})
		return nil
	})
	return nil
}
