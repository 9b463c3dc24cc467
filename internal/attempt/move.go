package attempt

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Move is one change of a saga, as the engine decides it: from state From
// at Version to To, ending one attempt of one step, and dispatching the
// next step if any. It is a value: the engine builds it, and the same SQL
// applies it in a step's own transaction (guessed from the command) or
// under the orchestrator's lock.
type Move struct {
	Saga       uuid.UUID
	Definition string
	From       saga.State
	Version    int64
	// To may equal From: a compensation done, the next one dispatched.
	To       saga.State
	Finished bool
	// Error, if not empty, becomes the saga's error.
	Error string
	// ResultStep, if not empty, records Result in the saga's results
	// under that step's name.
	ResultStep string
	Result     json.RawMessage

	// The step attempt the move ends, and how.
	Step         string
	Phase        saga.Phase
	Attempt      int
	Status       saga.StepStatus // StepSucceeded or StepFailed
	StepResult   json.RawMessage
	StepError    string
	PossiblyDone bool
	// RecordFailure makes the move, applied in a step, record the step's
	// failure in the inbox first (a database step that failed for good).
	RecordFailure bool

	// Next, if set, is the step this move dispatches, at attempt 1.
	Next *Dispatch
	// Outcome names how a finished saga ended (completed, compensated,
	// failed, parked), for metrics.
	Outcome string
}

// Dispatch is a step dispatched by a move: its row and its command.
type Dispatch struct {
	Step        string
	Phase       saga.Phase
	Index       int
	Key         uuid.UUID
	LeaseMillis int64
	Subject     string
	MsgID       string
	Payload     []byte
}

// lead is what the statement of an attempt's outcome writes to the inbox
// before the saga's part.
type lead int

const (
	// leadNone: nothing; a database step's success, whose claim wrote the
	// inbox row. Its result goes to the step's row with the move, or to
	// the inbox row with a reply.
	leadNone lead = iota
	// leadFailure inserts the inbox row of a database step's failure (its
	// transaction rolled back with the claim); an outcome stored meanwhile
	// stands, and the statement then writes nothing.
	leadFailure
	// leadExternal moves an external attempt's inbox row from started to
	// its outcome, fenced by the attempt: an attempt given up or taken
	// over meanwhile writes nothing.
	leadExternal
)

// fence says how a move's saga update is conditioned.
type fence int

const (
	// fenceGuess: the saga must still be where the command was written; if
	// it moved, the statement writes the reply instead.
	fenceGuess fence = iota
	// fenceLocked: the saga was locked and read in this transaction, so
	// a miss is a bug (idemsaga.invariant_broken). The step may be at
	// retrying, and an attempt row of its timeline is closed too.
	fenceLocked
)

// write is one statement that records an attempt's outcome: the lead, the
// move (nil: none) and the reply (nil: none, under fenceLocked). With a
// move and a reply, the reply is written only if the move missed.
type write struct {
	lead  lead
	fence fence
	// The attempt.
	saga    uuid.UUID
	key     uuid.UUID
	step    string
	phase   saga.Phase
	attempt int
	// What the lead records: for leadExternal the inbox outcome, and for
	// both leads and the fallback the result or error.
	inboxOutcome string
	unknown      bool
	result       json.RawMessage
	errText      string

	move    *Move
	reply   *outbox.Message
	handOff any // publish_after in milliseconds, nil for the relay
}

// written is what a write's statement reports.
type written struct {
	// led is set when the lead wrote (always for leadNone).
	led bool
	// moved is set when the move applied; created is then the saga's
	// start.
	moved   bool
	created time.Time
	// nextID and replyID are the outbox rows written, if any.
	nextID, replyID *int64
}

// lockClass is the first key of the advisory locks on step keys: a
// transaction that holds a step key (a claim not yet committed, an
// outcome being recorded) holds one shared, so that the engine can tell,
// without waiting on it, that the key is busy (pg_try_advisory_xact_lock).
// The two-key form's space is separate from the one-key form's.
const lockClass = 0x69646d73 // "idms"

// lockID is the second key of a step key's advisory lock. Two keys that
// share it only make each other look busy a moment longer.
func lockID(key uuid.UUID) int32 { return int32(binary.BigEndian.Uint32(key[12:16])) }

// LockID returns the second key of a step key's advisory lock, for the
// engine's settle (pg_try_advisory_xact_lock(LockClass, LockID(key))).
func LockID(key uuid.UUID) int32 { return lockID(key) }

// LockClass is the first key of the advisory locks on step keys.
const LockClass = lockClass

// stmtBuilder numbers a statement's parameters as it is written.
type stmtBuilder struct {
	args []any
}

func (b *stmtBuilder) p(v any) string {
	b.args = append(b.args, v)
	return "$" + strconv.Itoa(len(b.args))
}

// sql builds the statement and its arguments. The text depends only on
// the write's shape, so pgx's statement cache holds a few of them.
func (w write) sql() (string, []any) {
	var b stmtBuilder
	var ctes []string
	sagaP := b.p(pguuid.Of(w.saga))
	keyP := ""
	key := func() string {
		if keyP == "" {
			keyP = b.p(pguuid.Of(w.key))
		}
		return keyP
	}
	gate := ""
	switch w.lead {
	case leadFailure:
		ctes = append(ctes, fmt.Sprintf(`i as (
  insert into idemsaga.inbox (saga_id, step_key, step, phase, attempt, outcome, error)
  select s.id, %s, %s, %s::text, %s::int, 'failed', %s::text
  from idemsaga.sagas s, (select pg_advisory_xact_lock_shared(%d, %s)) l
  where s.id = %s
  on conflict (saga_id, step_key) do nothing
  returning 1
)`, key(), b.p(w.step), b.p(string(w.phase)), b.p(w.attempt), b.p(w.errText), lockClass, b.p(lockID(w.key)), sagaP))
		gate = "exists (select from i)"
	case leadExternal:
		ctes = append(ctes, fmt.Sprintf(`i as (
  update idemsaga.inbox x set outcome = %s::text, result = %s::jsonb, error = %s::text, unknown = x.unknown or %s::bool
  from (select pg_advisory_xact_lock_shared(%d, %s)) l
  where x.saga_id = %s and x.step_key = %s and x.attempt = %s::int and x.outcome = 'started'
  returning 1
)`, b.p(w.inboxOutcome), b.p(nullJSON(w.result)), b.p(nullText(w.errText)), b.p(w.unknown), lockClass, b.p(lockID(w.key)), sagaP, key(), b.p(w.attempt)))
		gate = "exists (select from i)"
	}
	var next, assert string
	if m := w.move; m != nil {
		var moveCTEs []string
		moveCTEs, next, assert = m.ctes(&b, sagaP, gate, w.fence, w.handOff)
		ctes = append(ctes, moveCTEs...)
	}
	replyID := "null::bigint"
	if w.reply != nil {
		when := []string{}
		if gate != "" {
			when = append(when, gate)
		}
		if w.move != nil {
			when = append(when, "not exists (select from u)")
		}
		if w.lead == leadNone && len(w.result) > 0 {
			// The result of a success answered by a reply goes to its
			// inbox row, for a later duplicate's answer.
			cond := ""
			if len(when) > 0 {
				cond = " and " + strings.Join(when, " and ")
			}
			ctes = append(ctes, fmt.Sprintf(`r as (
  update idemsaga.inbox set result = %s::jsonb where saga_id = %s and step_key = %s%s
)`, b.p(nullJSON(w.result)), sagaP, key(), cond))
		}
		cond := ""
		if len(when) > 0 {
			cond = "\n  where " + strings.Join(when, " and ")
		}
		ctes = append(ctes, fmt.Sprintf(`rep as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
  select %s::text, %s::text, %s::bytea, %s, clock_timestamp() + %s::bigint * interval '1 millisecond'%s
  returning id
)`, b.p(w.reply.Subject), b.p(w.reply.MsgID), b.p(w.reply.Payload), sagaP, b.p(w.handOff), cond))
		replyID = "(select id from rep)"
	}
	led := "true"
	if gate != "" {
		led = gate
	}
	created := "null::timestamptz"
	if w.move != nil {
		created = "(select created_at from u)"
	} else {
		next = "null::bigint"
	}
	if assert == "" {
		assert = "null::int"
	}
	sql := "with " + strings.Join(ctes, ",\n") + fmt.Sprintf("\nselect %s, %s, %s, %s, %s", led, created, next, replyID, assert)
	return sql, b.args
}

// ctes writes the move's part of a statement: the saga's update (u), the
// step's (f), its timeline's under fenceLocked (a), and the next step's
// row and command (st, o). It returns the expression of the command's
// outbox id and the invariant's check.
func (m *Move) ctes(b *stmtBuilder, sagaP, gate string, fn fence, handOff any) (ctes []string, next, assert string) {
	var set strings.Builder
	fmt.Fprintf(&set, "state = %s::text, version = version + 1, updated_at = now()", b.p(string(m.To)))
	if m.Finished {
		set.WriteString(", finished_at = now()")
	}
	if m.Error != "" {
		fmt.Fprintf(&set, ", error = %s::text", b.p(m.Error))
	}
	if m.ResultStep != "" {
		fmt.Fprintf(&set, ", results = results || jsonb_build_object(%s::text, coalesce(%s::jsonb, 'null'::jsonb))", b.p(m.ResultStep), b.p(nullJSON(m.Result)))
	}
	where := fmt.Sprintf("id = %s and state = %s::text and version = %s::bigint", sagaP, b.p(string(m.From)), b.p(m.Version))
	if gate != "" {
		where += " and " + gate
	}
	ctes = append(ctes, fmt.Sprintf("u as (\n  update idemsaga.sagas set %s\n  where %s\n  returning created_at\n)", set.String(), where))

	status := "status = 'dispatched'"
	if fn == fenceLocked {
		status = "status in ('dispatched', 'retrying')"
	}
	stErr := b.p(nullText(m.StepError))
	stStatus := b.p(string(m.Status))
	pd := ""
	if m.PossiblyDone {
		pd = ", possibly_done = true"
	}
	ctes = append(ctes, fmt.Sprintf(`f as (
  update idemsaga.steps set status = %s::text, result = %s::jsonb, last_error = %s::text%s,
    lease_until = null, next_attempt_at = null, updated_at = now()
  where saga_id = %s and step = %s and phase = %s::text and attempt = %s::int and %s
    and exists (select from u)
  returning saga_id, step, phase, attempt
)`, stStatus, b.p(nullJSON(m.StepResult)), stErr, pd, sagaP, b.p(m.Step), b.p(string(m.Phase)), b.p(m.Attempt), status))
	if fn == fenceLocked {
		ctes = append(ctes, fmt.Sprintf(`a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then %s::text else x.outcome end,
    error = coalesce(%s::text, x.error)
  from f where x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
)`, stStatus, stErr))
	}
	next = "null::bigint"
	if d := m.Next; d != nil {
		ctes = append(ctes, fmt.Sprintf(`st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select saga_id, %s::text, %s::text, %s::int, %s::uuid, 'dispatched', 1, now() + %s::bigint * interval '1 millisecond', now() from f
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
), o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after)
  select %s::text, %s::text, %s::bytea, saga_id, clock_timestamp() + %s::bigint * interval '1 millisecond' from st
  returning id
)`, b.p(d.Step), b.p(string(d.Phase)), b.p(d.Index), b.p(pguuid.Of(d.Key)), b.p(d.LeaseMillis),
			b.p(d.Subject), b.p(d.MsgID), b.p(d.Payload), b.p(handOff)))
		next = "(select id from o)"
	}
	what := b.p(fmt.Sprintf("the move of saga %s from %s at version %d to %s missed its step %s (%s) at attempt %d", m.Saga, m.From, m.Version, m.To, m.Step, m.Phase, m.Attempt))
	if fn == fenceLocked {
		assert = fmt.Sprintf("case when not exists (select from u) or not exists (select from f) then idemsaga.invariant_broken(%s) end", what)
	} else {
		assert = fmt.Sprintf("case when exists (select from u) and not exists (select from f) then idemsaga.invariant_broken(%s) end", what)
	}
	return ctes, next, assert
}

// scan reads what the statement reports into out, and records the outbox
// rows it wrote on tx.
func (w write) scan(tx *Tx, out *written) func(pgx.Row) error {
	return func(row pgx.Row) error {
		var created *time.Time
		var invariant *int
		if err := row.Scan(&out.led, &created, &out.nextID, &out.replyID, &invariant); err != nil {
			return fmt.Errorf("record the outcome of step %q (%s) of saga %s at attempt %d: %w", w.step, w.phase, w.saga, w.attempt, err)
		}
		if created != nil {
			out.moved, out.created = true, *created
		}
		if out.nextID != nil {
			d := w.move.Next
			tx.Sent(outbox.Committed{ID: *out.nextID, Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload})
		}
		if out.replyID != nil {
			tx.Sent(outbox.Committed{ID: *out.replyID, Subject: w.reply.Subject, MsgID: w.reply.MsgID, Payload: w.reply.Payload})
		}
		return nil
	}
}

// queue adds the write's statement to tx; out is filled when it is sent.
func (w write) queue(tx *Tx, out *written) {
	sql, args := w.sql()
	tx.Queue(sql, w.scan(tx, out), args...)
}

// QueueMove queues m on tx, a transaction that locked m's saga and read it
// at m.Version (the orchestrator's): m's writes cannot miss, and a miss
// fails the transaction as a bug. handOff is the next command's
// publish_after in milliseconds, nil for the relay. moved, if not nil,
// receives the saga's start once the statement ran.
func QueueMove(tx *Tx, m *Move, handOff any, created *time.Time) {
	w := write{lead: leadNone, fence: fenceLocked, saga: m.Saga, step: m.Step, phase: m.Phase, attempt: m.Attempt, move: m, handOff: handOff}
	out := &written{}
	sql, args := w.sql()
	scan := w.scan(tx, out)
	tx.Queue(sql, func(row pgx.Row) error {
		if err := scan(row); err != nil {
			return err
		}
		if created != nil {
			*created = out.created
		}
		return nil
	}, args...)
}

// nullJSON passes JSON as text, so that pgx's simple protocol (a pooler
// in transaction mode) sends it as JSON, not as a bytea literal.
func nullJSON(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return string(b)
}

func nullText(s string) any {
	if s == "" {
		return nil
	}
	return s
}
