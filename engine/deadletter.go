package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/store"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Dead letters are commands a step worker could not run, because it does
// not know their definition, version or step, after a bounded number of
// deliveries (internal/attempt parks them). They wait in
// idemsaga.dead_letters until a worker that runs their version sends them
// again (resumeDeadLetters, at its start and with every heartbeat), or a
// person does (Client.ResendDeadLetters) or drops them
// (Client.DropDeadLetters).

// DeadLetterFilter filters Client.DeadLetters. Zero fields do not filter.
type DeadLetterFilter struct {
	// SagaID keeps the dead letters of one saga.
	SagaID uuid.UUID
	// Definition keeps those of one definition, and Version, if set, of
	// one version of it.
	Definition string
	Version    int
	// Limit bounds the result. Defaults to 100.
	Limit int
}

// DeadLetters returns the parked commands matching f, oldest first.
func (cl *Client) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]saga.DeadLetter, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	if f.Version < 0 {
		return nil, fmt.Errorf("%w: version %d; versions start at 1", ErrInvalidFilter, f.Version)
	}
	var id any
	if f.SagaID != uuid.Nil {
		id = pguuid.Of(f.SagaID)
	}
	return queryDeadLetters(ctx, cl.c.Pool(), cl.c.Schema().SQL(store.ListDeadLetters), id, f.Definition, f.Version, f.Limit)
}

func queryDeadLetters(ctx context.Context, q orchestrate.Querier, sql string, args ...any) ([]saga.DeadLetter, error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (saga.DeadLetter, error) {
		var d saga.DeadLetter
		var phase string
		err := row.Scan(&d.ID, &d.SagaID, &d.Definition, &d.DefinitionVersion, &d.Step, &phase, &d.Attempt, &d.Subject, &d.MsgID,
			&d.Reason, &d.Deliveries, &d.ParkedBy, &d.FirstSeen, &d.LastSeen)
		d.Phase = saga.Phase(phase)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list dead letters: %w", err)
	}
	return out, nil
}

// ErrDeadLetterNotFound is returned by ResendDeadLetters and
// DropDeadLetters for an id the dead-letter table does not hold (sent
// again or dropped already, or never parked). Nothing is changed.
var ErrDeadLetterNotFound = errors.New("idemsaga: no such dead letter")

// ResendDeadLetters sends the given dead letters again, whoever runs
// their version: each one's command goes into the outbox and its row is
// deleted, in one transaction. A command still unknown to the workers
// that receive it is parked again after its deliveries. Sending one again
// is safe at any time: it is one attempt of one step, fenced by the step's
// attempt and key, so nothing runs twice. An id not in the table is
// ErrDeadLetterNotFound, and nothing is sent.
func (cl *Client) ResendDeadLetters(ctx context.Context, ids ...int64) error {
	var rows []outbox.Committed
	err := cl.inTx(ctx, func(tx pgx.Tx) (err error) {
		rows, err = cl.resendTx(ctx, tx, ids, cl.c.HandOffArg())
		return err
	})
	if err != nil {
		return err
	}
	cl.c.Resent(rows, "resend")
	return nil
}

// ResendDeadLettersTx is ResendDeadLetters in the caller's transaction;
// the relay publishes the commands after it commits. On an error the
// caller must roll back.
func (cl *Client) ResendDeadLettersTx(ctx context.Context, tx pgx.Tx, ids ...int64) error {
	rows, err := cl.resendTx(ctx, tx, ids, nil)
	if err == nil {
		for _, r := range rows {
			if cmd, derr := wire.DecodeCommand(r.Payload); derr == nil {
				cl.c.Metrics().DeadLettersResumed.WithLabelValues(cmd.Definition, "resend").Inc()
			}
		}
	}
	return err
}

func (cl *Client) resendTx(ctx context.Context, tx pgx.Tx, ids []int64, handOff any) ([]outbox.Committed, error) {
	ids = distinct(ids)
	if len(ids) == 0 {
		return nil, fmt.Errorf("%w: give the ids of the dead letters to send again (`dead-letters list`)", ErrDeadLetterNotFound)
	}
	rows, err := cl.c.Resend(ctx, tx, nil, ids, len(ids), handOff)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: send dead letters again: %w", err)
	}
	if len(rows) != len(ids) {
		return nil, fmt.Errorf("%w: %d of dead letters %s are not parked (sent again or dropped already, or held by a worker sending them now); nothing was sent; list them with `dead-letters list`",
			ErrDeadLetterNotFound, len(ids)-len(rows), joinIDs(ids))
	}
	return rows, nil
}

// DropDeadLetters deletes the given dead letters: their commands are not
// sent again. The saga's step stays as it is; its lease drives it again
// once a worker that runs its version runs, or cancel the saga. An id not
// in the table is ErrDeadLetterNotFound, and nothing is dropped.
func (cl *Client) DropDeadLetters(ctx context.Context, ids ...int64) error {
	return cl.inTx(ctx, func(tx pgx.Tx) error { return cl.DropDeadLettersTx(ctx, tx, ids...) })
}

// DropDeadLettersTx is DropDeadLetters in the caller's transaction. On an
// error the caller must roll back.
func (cl *Client) DropDeadLettersTx(ctx context.Context, tx pgx.Tx, ids ...int64) error {
	ids = distinct(ids)
	if len(ids) == 0 {
		return fmt.Errorf("%w: give the ids of the dead letters to drop (`dead-letters list`)", ErrDeadLetterNotFound)
	}
	rows, err := cl.c.Schema().Q(tx).Query(ctx, store.DropDeadLetters, ids)
	if err != nil {
		return fmt.Errorf("idemsaga: drop dead letters: %w", err)
	}
	dropped, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("idemsaga: drop dead letters: %w", err)
	}
	if len(dropped) != len(ids) {
		return fmt.Errorf("%w: %d of dead letters %s are not parked (sent again or dropped already); nothing was dropped; list them with `dead-letters list`",
			ErrDeadLetterNotFound, len(ids)-len(dropped), joinIDs(ids))
	}
	return nil
}

// inTx runs fn in a transaction of its own.
func (cl *Client) inTx(ctx context.Context, fn func(pgx.Tx) error) error {
	tx, err := cl.c.Pool().Begin(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: commit: %w", err)
	}
	return nil
}

func distinct(ids []int64) []int64 {
	out := slices.Clone(ids)
	slices.Sort(out)
	return slices.Compact(out)
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = fmt.Sprint(id)
	}
	return strings.Join(s, ", ")
}
