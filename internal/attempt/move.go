package attempt

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
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
	// Headers are the command's message headers (its trace context), nil
	// for none.
	Headers map[string]string
}

// lead is what the statement of an attempt's outcome writes to the inbox
// before the saga's part.
type lead int

const (
	// leadNone: nothing; a database step's success, whose claim wrote the
	// inbox row. Its result goes to the step's row with the move, or to
	// the inbox row with a reply.
	leadNone lead = iota
	// leadFailure records a database step's failure (inboxOutcome: failed,
	// or retry for an attempt that ended without effect) in the
	// transaction that ends its claim, rolled back to the claim's
	// savepoint: the claim's own row, held since, takes the outcome.
	leadFailure
	// leadFailureAlone records a database step's failure in a transaction
	// of its own, after the claim's ended without it (its connection broke,
	// or the handler ended the transaction): the key's row is inserted, or
	// taken from an earlier attempt's retry; an outcome stored meanwhile
	// stands, and the statement then writes nothing.
	leadFailureAlone
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
// move (nil: none) and the reply (nil: none). A move in a step carries no
// reply: when it misses (the saga moved), the attempt writes the reply in
// a transaction of its own.
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

	// proof is the outcome the inbox holds for the key at attempt once
	// this write committed, and not before: what tells whether a COMMIT
	// whose answer was lost committed (resolve). Empty: the write leaves
	// no such mark, and a lost answer counts as not committed.
	proof string

	move *Move
	// eager leaves out the outbox row of the step the move dispatches:
	// this process runs it at once, and its step row's lease is its
	// durable record.
	eager   bool
	reply   *outbox.Message
	handOff any // publish_after in milliseconds, nil for the relay
}

// written is what a write's statement reports.
type written struct {
	// led is set when the lead wrote (always for leadNone).
	led bool
	// moved is set when the move applied; created is then the saga's
	// start, and dispatched is set when it dispatched its next step.
	moved, dispatched bool
	created           time.Time
	// nextID and replyID are the outbox rows written, if any.
	nextID, replyID *int64
}

// lockClass is the first key of the advisory locks on step keys: a
// transaction that holds a step key (a claim not yet committed, an
// outcome being recorded) holds one shared, so that the engine can tell,
// without waiting on it, that the key is busy (pg_try_advisory_xact_lock).
// The two-key form's space is separate from the one-key form's.
const lockClass = 0x69646d73 // "idms"

// LockClass is the first key of the advisory locks on step keys.
const LockClass = lockClass

// lockID is the second key of a step key's advisory lock. Two keys that
// share it only make each other look busy a moment longer.
func lockID(key uuid.UUID) int32 { return int32(binary.BigEndian.Uint32(key[12:16])) }

// LockID returns the second key of a step key's advisory lock, for the
// engine's settle (pg_try_advisory_xact_lock(LockClass, LockID(key))).
func LockID(key uuid.UUID) int32 { return lockID(key) }

// shape is what a write's SQL text depends on.
type shape struct {
	lead                                       lead
	fence                                      fence
	move, finished, errText, resultStep, maybe bool
	next, eager, reply, keepResult             bool
	// nextHeaders and replyHeaders: the outbox rows carry headers.
	nextHeaders, replyHeaders bool
}

func (w write) shape() shape {
	sh := shape{lead: w.lead, fence: w.fence, move: w.move != nil, eager: w.eager, reply: w.reply != nil}
	if m := w.move; m != nil {
		sh.finished, sh.errText, sh.resultStep, sh.maybe, sh.next = m.Finished, m.Error != "", m.ResultStep != "", m.PossiblyDone, m.Next != nil
		sh.nextHeaders = m.Next != nil && m.Next.Headers != nil
	}
	sh.replyHeaders = w.reply != nil && w.reply.Headers != nil
	// The result of a database step's success that is not applied in its
	// step goes to its inbox row, for a later duplicate's answer.
	sh.keepResult = w.lead == leadNone && len(w.result) > 0
	return sh
}

// texts caches the SQL of each shape: the text depends on the shape only,
// so pgx's statement cache holds a few of them.
var texts sync.Map // shape -> string

// stmtBuilder writes a statement and numbers its parameters; without
// text it only gathers the arguments, in the same order.
type stmtBuilder struct {
	args []any
	text *strings.Builder
}

func (b *stmtBuilder) p(v any) string {
	b.args = append(b.args, v)
	if b.text == nil {
		return ""
	}
	return "$" + strconv.Itoa(len(b.args))
}

func (b *stmtBuilder) f(format string, a ...any) {
	if b.text != nil {
		fmt.Fprintf(b.text, format, a...)
	}
}

// sql returns the statement and its arguments.
func (w write) sql() (string, []any) {
	sh := w.shape()
	if t, ok := texts.Load(sh); ok {
		b := stmtBuilder{args: make([]any, 0, 24)}
		w.build(&b, sh)
		return t.(string), b.args
	}
	b := stmtBuilder{text: &strings.Builder{}}
	w.build(&b, sh)
	text := b.text.String()
	texts.Store(sh, text)
	return text, b.args
}

// build writes the statement of shape sh: its CTEs, then one row of what
// it did (led, created, dispatched, the next command's outbox id, the
// reply's outbox id, and the invariant's check).
func (w write) build(b *stmtBuilder, sh shape) {
	sagaP := b.p(pguuid.Of(w.saga))
	keyP := ""
	key := func() string {
		if keyP == "" {
			keyP = b.p(pguuid.Of(w.key))
		}
		return keyP
	}
	b.f("with ")
	first := true
	cte := func() {
		if !first {
			b.f(",\n")
		}
		first = false
	}
	gate := ""
	switch w.lead {
	case leadFailure:
		cte()
		b.f(`i as (
  update idemsaga.inbox set outcome = %s::text, error = %s::text, result = null
  where saga_id = %s and step_key = %s and attempt = %s::int and outcome = 'succeeded'
  returning 1
)`, b.p(w.inboxOutcome), b.p(w.errText), sagaP, key(), b.p(w.attempt))
		gate = "exists (select from i)"
	case leadFailureAlone:
		cte()
		b.f(`i as (
  insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome, error)
  select s.id, %s, %s, %s::text, %s::int, %s::text, %s::text
  from idemsaga.sagas s
  where s.id = %s and pg_advisory_xact_lock_shared(%d, %s) is not null
  on conflict (saga_id, step_key) do update set attempt = excluded.attempt, outcome = excluded.outcome, error = excluded.error, result = null
    where x.outcome = 'retry' and x.attempt < excluded.attempt
  returning 1
)`, key(), b.p(w.step), b.p(string(w.phase)), b.p(w.attempt), b.p(w.inboxOutcome), b.p(w.errText), sagaP, lockClass, b.p(lockID(w.key)))
		gate = "exists (select from i)"
	case leadExternal:
		cte()
		b.f(`i as (
  update idemsaga.inbox x set outcome = %s::text, result = %s::jsonb, error = %s::text, unknown = x.unknown or %s::bool
  where x.saga_id = %s and x.step_key = %s and x.attempt = %s::int and x.outcome = 'started'
    and pg_advisory_xact_lock_shared(%d, %s) is not null
  returning 1
)`, b.p(w.inboxOutcome), b.p(nullJSON(w.result)), b.p(nullText(w.errText)), b.p(w.unknown), sagaP, key(), b.p(w.attempt), lockClass, b.p(lockID(w.key)))
		gate = "exists (select from i)"
	}
	next, dispatched, assert := "null::bigint", "false", "null::int"
	if w.move != nil {
		cte()
		next, dispatched, assert = w.move.build(b, sh, sagaP, gate, w.handOff)
	}
	// Where the move did not apply (or there is none), what the attempt
	// leaves instead: the result in the inbox row, the reply.
	var when []string
	if gate != "" {
		when = append(when, gate)
	}
	if w.move != nil {
		when = append(when, "not exists (select from u)")
	}
	cond := func(prefix string) string {
		if len(when) == 0 {
			return ""
		}
		return prefix + strings.Join(when, " and ")
	}
	if sh.keepResult && (w.move != nil || w.reply != nil) {
		cte()
		b.f(`r as (
  update idemsaga.inbox set result = %s::jsonb where saga_id = %s and step_key = %s%s
)`, b.p(nullJSON(w.result)), sagaP, key(), cond(" and "))
	}
	replyID := "null::bigint"
	if w.reply != nil {
		cte()
		cols, vals := "", ""
		if sh.replyHeaders {
			cols, vals = ", headers", ", "+b.p(HeadersJSON(w.reply.Headers))+"::jsonb"
		}
		b.f(`rep as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after%s)
  select %s::text, %s::text, %s::bytea, %s, clock_timestamp() + %s::bigint * interval '1 millisecond'%s%s
  returning id
)`, cols, b.p(w.reply.Subject), b.p(w.reply.MsgID), b.p(w.reply.Payload), sagaP, b.p(w.handOff), vals, cond("\n  where "))
		replyID = "(select id from rep)"
	}
	led, created := "true", "null::timestamptz"
	if gate != "" {
		led = gate
	}
	if w.move != nil {
		created = "(select created_at from u)"
	}
	b.f("\nselect %s, %s, %s, %s, %s, %s", led, created, dispatched, next, replyID, assert)
}

// build writes the move's part of a statement: the saga's update (u), the
// step's (f), its timeline's under fenceLocked (a), and the next step's
// row (st) and, unless it runs eagerly, its command (o). It returns the
// expressions of the command's outbox id, of whether the next step was
// dispatched, and of the invariant's check.
func (m *Move) build(b *stmtBuilder, sh shape, sagaP, gate string, handOff any) (next, dispatched, assert string) {
	b.f("u as (\n  update idemsaga.sagas set state = %s::text, version = version + 1, updated_at = idemsaga.now()", b.p(string(m.To)))
	if m.Finished {
		b.f(", finished_at = idemsaga.now()")
	}
	if m.Error != "" {
		b.f(", error = %s::text", b.p(m.Error))
	}
	if m.ResultStep != "" {
		b.f(", results = results || jsonb_build_object(%s::text, coalesce(%s::jsonb, 'null'::jsonb))", b.p(m.ResultStep), b.p(nullJSON(m.Result)))
	}
	b.f("\n  where id = %s and state = %s::text and version = %s::bigint", sagaP, b.p(string(m.From)), b.p(m.Version))
	if gate != "" {
		b.f(" and %s", gate)
	}
	b.f("\n  returning created_at\n)")

	status := "status = 'dispatched'"
	if sh.fence == fenceLocked {
		status = "status in ('dispatched', 'retrying', 'waiting')"
	}
	stStatus := b.p(string(m.Status))
	stErr := b.p(nullText(m.StepError))
	pd := ""
	if m.PossiblyDone {
		pd = ", possibly_done = true"
	}
	b.f(`, f as (
  update idemsaga.steps set status = %s::text, result = %s::jsonb, last_error = %s::text%s,
    lease_until = null, next_attempt_at = null, updated_at = idemsaga.now()
  where saga_id = %s and step = %s and phase = %s::text and attempt = %s::int and %s
    and exists (select from u)
  returning saga_id, step, phase, attempt
)`, stStatus, b.p(nullJSON(m.StepResult)), stErr, pd, sagaP, b.p(m.Step), b.p(string(m.Phase)), b.p(m.Attempt), status)
	if sh.fence == fenceLocked {
		b.f(`, a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, idemsaga.now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then %s::text else x.outcome end,
    error = coalesce(%s::text, x.error)
  from f where x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
)`, stStatus, stErr)
	}
	next, dispatched = "null::bigint", "false"
	if d := m.Next; d != nil {
		b.f(`, st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select saga_id, %s::text, %s::text, %s::int, %s::uuid, 'dispatched', 1, idemsaga.now() + %s::bigint * interval '1 millisecond', idemsaga.now() from f
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
)`, b.p(d.Step), b.p(string(d.Phase)), b.p(d.Index), b.p(pguuid.Of(d.Key)), b.p(d.LeaseMillis))
		dispatched = "exists (select from st)"
		if !sh.eager {
			cols, vals := "", ""
			if sh.nextHeaders {
				cols, vals = ", headers", ", "+b.p(HeadersJSON(d.Headers))+"::jsonb"
			}
			b.f(`, o as (
  insert into idemsaga.outbox (subject, msg_id, payload, saga_id, publish_after%s)
  select %s::text, %s::text, %s::bytea, saga_id, clock_timestamp() + %s::bigint * interval '1 millisecond'%s from st
  returning id
)`, cols, b.p(d.Subject), b.p(d.MsgID), b.p(d.Payload), b.p(handOff), vals)
			next = "(select id from o)"
		}
	}
	what := b.p(fmt.Sprintf("the move of saga %s from %s at version %d to %s missed its step %s (%s) at attempt %d", m.Saga, m.From, m.Version, m.To, m.Step, m.Phase, m.Attempt))
	if sh.fence == fenceLocked {
		assert = fmt.Sprintf("case when not exists (select from u) or not exists (select from f) then idemsaga.invariant_broken(%s) end", what)
	} else {
		assert = fmt.Sprintf("case when exists (select from u) and not exists (select from f) then idemsaga.invariant_broken(%s) end", what)
	}
	return next, dispatched, assert
}

// scan reads what the statement reports into out, and records the outbox
// rows it wrote on tx.
func (w write) scan(tx *Tx, out *written) func(pgx.Row) error {
	return func(row pgx.Row) error {
		var created *time.Time
		var invariant *int
		if err := row.Scan(&out.led, &created, &out.dispatched, &out.nextID, &out.replyID, &invariant); err != nil {
			return fmt.Errorf("record the outcome of step %q (%s) of saga %s at attempt %d: %w", w.step, w.phase, w.saga, w.attempt, err)
		}
		if created != nil {
			out.moved, out.created = true, *created
		}
		if out.nextID != nil {
			d := w.move.Next
			tx.Sent(outbox.Committed{ID: *out.nextID, Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers})
		}
		if out.replyID != nil {
			tx.Sent(outbox.Committed{ID: *out.replyID, Subject: w.reply.Subject, MsgID: w.reply.MsgID, Payload: w.reply.Payload, Headers: w.reply.Headers})
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
// publish_after in milliseconds, nil for the relay. The next command
// carries tx's trace context (Tx.SetTrace) unless it has headers of its
// own. moved, if not nil,
// receives the saga's start once the statement ran.
func QueueMove(tx *Tx, m *Move, handOff any, created *time.Time) {
	if m.Next != nil && m.Next.Headers == nil {
		m.Next.Headers = tx.trace
	}
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

// HeadersJSON passes an outbox row's headers as JSON text (as nullJSON
// does), NULL for none.
func HeadersJSON(h map[string]string) any {
	if len(h) == 0 {
		return nil
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil // a map of strings always encodes
	}
	return string(b)
}

func nullText(s string) any {
	if s == "" {
		return nil
	}
	return s
}
