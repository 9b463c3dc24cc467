package outbox

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/pguuid"
)

// Message is one row to publish.
type Message struct {
	// Subject is the JetStream subject.
	Subject string
	// MsgID goes into the Nats-Msg-Id header, so the broker drops a second
	// copy of the same row within its dedup window.
	MsgID string
	// Payload is the message body.
	Payload []byte
	// Headers are extra message headers. Optional.
	Headers map[string]string
	// SagaID ties the row to a saga, so retention keeps the saga while the
	// row is unpublished. Optional.
	SagaID uuid.UUID
}

// Write inserts msgs into the outbox of schema idemsaga inside the
// caller's transaction, so they are published if and only if that
// transaction commits.
func Write(ctx context.Context, tx pgx.Tx, msgs ...Message) error {
	return WriteIn(ctx, tx, "", msgs...)
}

// WriteIn is Write to the outbox of a deployment's schema
// (engine.Config.Schema; "" for idemsaga).
func WriteIn(ctx context.Context, tx pgx.Tx, schema string, msgs ...Message) error {
	sch, err := pgschema.New(schema)
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if len(msgs) == 0 {
		return nil
	}
	subjects := make([]string, len(msgs))
	ids := make([]string, len(msgs))
	payloads := make([][]byte, len(msgs))
	headers := make([][]byte, len(msgs))
	sagas := make([]pgtype.UUID, len(msgs))
	for i, m := range msgs {
		h, err := m.encodedHeaders(i)
		if err != nil {
			return err
		}
		subjects[i], ids[i], payloads[i], headers[i], sagas[i] = m.Subject, m.MsgID, m.Payload, h, pguuid.OrNull(m.SagaID)
	}
	if len(msgs) == 1 {
		_, err := sch.Q(tx).Exec(ctx, insertOne, subjects[0], ids[0], payloads[0], headers[0], sagas[0])
		if err != nil {
			return fmt.Errorf("outbox: insert: %w", err)
		}
		return nil
	}
	if _, err := sch.Q(tx).Exec(ctx, insertMany, subjects, ids, payloads, headers, sagas); err != nil {
		return fmt.Errorf("outbox: insert %d rows: %w", len(msgs), err)
	}
	return nil
}

// encodedHeaders checks the i-th message of a write and returns its
// headers as JSON (nil when it has none).
func (m Message) encodedHeaders(i int) ([]byte, error) {
	if m.Subject == "" || m.MsgID == "" {
		return nil, fmt.Errorf("outbox: message %d has an empty subject or message id", i)
	}
	if len(m.Headers) == 0 {
		return nil, nil
	}
	h, err := json.Marshal(m.Headers)
	if err != nil {
		return nil, fmt.Errorf("outbox: encode headers of message %d: %w", i, err)
	}
	return h, nil
}
