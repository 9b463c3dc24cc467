package orchestrate

import (
	"context"
	"fmt"

	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/jackc/pgx/v5"
)

// ResumeBatch bounds the dead letters one pass of ResumeDeadLetters
// sends again.
const ResumeBatch = 100

// stepRefs returns "name@version:step" of every step this process runs.
func (c *Core) stepRefs() []string {
	var refs []string
	for _, d := range c.versions {
		for _, st := range d.Steps() {
			refs = append(refs, d.Ref()+":"+st.Name)
		}
	}
	return refs
}

// resumeDeadLetters sends again the dead letters of the steps this
// process runs, up to limit, and returns how many.
func (c *Core) ResumeDeadLetters(ctx context.Context, limit int) (int, error) {
	rows, err := c.Resend(ctx, c.pool, c.stepRefs(), nil, limit, c.handOffArg())
	if err != nil {
		return 0, fmt.Errorf("idemsaga: send dead letters again: %w", err)
	}
	c.Resent(rows, "worker")
	return len(rows), nil
}

type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func (c *Core) Resend(ctx context.Context, q Querier, steps []string, ids []int64, limit int, handOff any) ([]outbox.Committed, error) {
	rows, err := q.Query(ctx, c.schema.SQL(store.ResendDeadLetters), steps, ids, limit, handOff)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (outbox.Committed, error) {
		var r outbox.Committed
		err := row.Scan(&r.ID, &r.Subject, &r.MsgID, &r.Payload, &r.Headers)
		return r, err
	})
}

// resent counts and logs committed resends, then publishes them.
func (c *Core) Resent(rows []outbox.Committed, how string) {
	for _, r := range rows {
		def := "unknown"
		if cmd, err := wire.DecodeCommand(r.Payload); err == nil {
			def = cmd.Definition
			c.log.Info("dead letter sent again", "how", how, "saga_id", cmd.SagaID, "definition", saga.Ref(cmd.Definition, cmd.DefVersion()),
				"step", cmd.Step, "phase", cmd.Phase, "attempt", cmd.Attempt, "msg_id", r.MsgID)
		}
		c.metrics.DeadLettersResumed.WithLabelValues(def, how).Inc()
	}
	c.sent(rows)
}
