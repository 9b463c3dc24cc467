package attempt

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/outbox"
)

// A COMMIT whose answer was lost (the server crashed or failed over, the
// connection broke) may have committed. An attempt that took such an
// error for a failure would lose what only its process knew: the command
// of the step its move dispatched, run here at once without an outbox row
// (its lease would drive it again, a lease later), and the rows it was to
// publish (the relay's sweep would take them, a hand-off later). So the
// attempt asks the database, once it answers again, whether its write
// committed, from what only that commit leaves: the inbox row of the
// attempt at its outcome (write.proof). It asks only once the server
// process that ran the write is gone: a client that gives up (its
// deadline, a broken socket) does not stop the server, which may still
// commit the write after a read on another connection found nothing.

// inDoubt reports whether err, from the batch that carried a transaction's
// COMMIT, leaves the transaction's outcome unknown: the batch was sent, and
// no answer from the server says it failed.
func inDoubt(err error) bool {
	var pgErr *pgconn.PgError
	// Anything else (the connection broke, or the attempt's own deadline
	// cut the batch) may have come after the COMMIT reached the server.
	return err != nil && !errors.As(err, &pgErr) && !pgconn.SafeToRetry(err)
}

// resolveTimeout bounds how long an attempt waits for the database to
// answer whether a commit in doubt committed: a failover's length. Past it
// the attempt counts as not committed, and what it dispatched is driven
// again by its lease and the relay's sweep.
const resolveTimeout = 30 * time.Second

// resolveEvery is the pause between tries while the database is away.
const resolveEvery = 100 * time.Millisecond

// readCommitted reads back, for write w of an attempt: the outcome the
// inbox holds for its key at its attempt, the status of its step at its
// attempt, whether the step its move dispatches exists, and the outbox
// rows of the next command ($6) and of the reply ($7) still unpublished,
// with the saga's start.
const readCommitted = `select
  (select outcome::text from idemsaga.inbox where saga_id = $1 and step_key = $2 and attempt = $3),
  (select status::text from idemsaga.steps where saga_id = $1 and step = $4 and phase = $5 and attempt = $3),
  exists (select 1 from idemsaga.steps where saga_id = $1 and step = $8 and phase = $9),
  (select min(id) from idemsaga.outbox where saga_id = $1 and msg_id = $6 and published_at is null),
  (select min(id) from idemsaga.outbox where saga_id = $1 and msg_id = $7 and published_at is null),
  (select created_at from idemsaga.sagas where id = $1)`

// backend names the server process of a connection: its pid, and the
// connection's own port as the server sees it (-1 over a Unix socket),
// which tells it apart from a later process given the same pid.
type backend struct {
	pid  uint32
	port int
}

func backendOf(c *pgx.Conn) backend {
	b := backend{pid: c.PgConn().PID(), port: -1}
	if addr, ok := c.PgConn().Conn().LocalAddr().(*net.TCPAddr); ok {
		b.port = addr.Port
	}
	return b
}

// backendRuns tells whether a server process ($1, $2: backend) may still
// commit what it was sent: it runs a statement, or holds a transaction
// open (then it ends at the client's Terminate, or at the claim's idle
// timeout). An idle one has finished; a new server (a failover's) has
// none of the old one's.
const backendRuns = `select exists (select 1 from pg_stat_activity where pid = $1 and coalesce(client_port, -1) = $2 and state is distinct from 'idle')`

// resolve finds out whether w, whose COMMIT is in doubt, committed, once
// by, the server process that ran it, is gone. It returns what the
// write's statement would have reported and true if it did, false if it
// did not or the database did not answer in time.
func (a *attempt) resolve(ctx context.Context, w store.Record, reply *outbox.Message, by backend) (store.Recorded, bool) {
	if w.Proof == "" {
		return store.Recorded{}, false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resolveTimeout)
	defer cancel()
	var nextStep, nextPhase, nextMsg, replyMsg any
	if w.Move != nil && w.Move.Next != nil {
		nextStep, nextPhase, nextMsg = w.Move.Next.Step, string(w.Move.Next.Phase), w.Move.Next.MsgID
	}
	if reply != nil {
		replyMsg = reply.MsgID
	}
	// It asks on a connection of its own, outside the pool: the attempts
	// a failover left in doubt each hold a broken connection of the pool
	// until they know, and together they may hold all of it.
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close(context.Background())
		}
	}()
	gone := false
	for {
		if conn == nil || conn.IsClosed() {
			c, err := pgx.ConnectConfig(ctx, a.r.cfg.Pool.Config().ConnConfig)
			if err == nil {
				conn = c
			}
		}
		if conn != nil {
			q := a.r.cfg.Schema.Q(conn)
			if !gone {
				// The process ends once it has run what it was sent, up
				// to the client's Terminate after it.
				var runs bool
				err := q.QueryRow(ctx, backendRuns, int64(by.pid), by.port).Scan(&runs)
				gone = err == nil && !runs
			}
			if gone {
				var outcome, status *string
				var dispatched bool
				var nextID, replyID *int64
				var created *time.Time
				err := q.QueryRow(ctx, readCommitted, pguuid.Of(w.Saga), pguuid.Of(w.Key), w.Attempt, w.Step, string(w.Phase),
					nextMsg, replyMsg, nextStep, nextPhase).Scan(&outcome, &status, &dispatched, &nextID, &replyID, &created)
				if err == nil {
					if outcome == nil || *outcome != w.Proof {
						return store.Recorded{}, false
					}
					out := store.Recorded{Led: true, ReplyID: replyID}
					if m := w.Move; m != nil && status != nil && *status == string(m.Status) && created != nil {
						out.Moved, out.Created = true, *created
						out.Dispatched = m.Next != nil && dispatched
						out.NextID = nextID
					}
					return out, true
				}
				if errors.Is(err, pgx.ErrNoRows) {
					return store.Recorded{}, false
				}
			}
		}
		select {
		case <-ctx.Done():
			return store.Recorded{}, false
		case <-time.After(resolveEvery):
		}
	}
}

// committedRows are the outbox rows a write resolved as committed left to
// publish.
func committedRows(w store.Record, reply *outbox.Message, out store.Recorded) []outbox.Committed {
	var rows []outbox.Committed
	if out.NextID != nil {
		d := w.Move.Next
		rows = append(rows, outbox.Committed{ID: *out.NextID, Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers})
	}
	if out.ReplyID != nil && reply != nil {
		rows = append(rows, outbox.Committed{ID: *out.ReplyID, Subject: reply.Subject, MsgID: reply.MsgID, Payload: reply.Payload, Headers: reply.Headers})
	}
	return rows
}
