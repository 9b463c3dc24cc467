package store

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/idemsaga/idemsaga/saga"
)

// Move is one change of a saga, as the engine decides it: from state From
// at Version to To, ending one attempt of one step, and dispatching the
// next step if any. It is a value: the engine builds it, and the same
// statement applies it in a step's own transaction (guessed from the
// command) or under the orchestrator's lock.
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

// Lead is what a Record writes to the inbox before the saga's part.
type Lead int

const (
	// LeadNone writes nothing: a database step's success, whose claim
	// wrote the inbox row, or an answer from what the inbox holds. Its
	// result goes to the step's row with the move, or to the inbox row
	// with a reply.
	LeadNone Lead = iota
	// LeadFailure records a database step's failure (InboxOutcome: failed,
	// or retry for an attempt that ended without effect) in the
	// transaction that ends its claim, rolled back to the claim's
	// savepoint: the claim's own row, held since, takes the outcome.
	LeadFailure
	// LeadFailureAlone records a database step's failure in a transaction
	// of its own, after the claim's ended without it (its connection broke,
	// or the handler ended the transaction): the key's row is inserted, or
	// taken from an earlier attempt's retry; an outcome stored meanwhile
	// stands, and the statement then writes nothing.
	LeadFailureAlone
	// LeadExternal moves an external attempt's inbox row from started to
	// its outcome, fenced by the attempt: an attempt given up or taken
	// over meanwhile writes nothing.
	LeadExternal
)

// Record is one statement that records a step attempt's outcome, in the
// attempt's own transaction: the lead, the move (nil: none) and the reply
// (nil: none). The move is fenced by the saga's state and version as the
// command saw them; where it misses (the saga moved), or where there is
// none, the reply is written instead, so the orchestrator decides.
type Record struct {
	Lead Lead
	// The attempt.
	Saga    uuid.UUID
	Key     uuid.UUID
	Step    string
	Phase   saga.Phase
	Attempt int
	// What the lead records: for LeadExternal the inbox outcome, and for
	// the failure leads the outcome and error.
	InboxOutcome string
	Unknown      bool
	Result       json.RawMessage
	ErrText      string

	// Proof is the outcome the inbox holds for the key at Attempt once
	// this record committed, and not before: what tells whether a COMMIT
	// whose answer was lost committed. Empty: the record leaves no such
	// mark, and a lost answer counts as not committed.
	Proof string

	Move *Move
	// Eager leaves out the outbox row of the step the move dispatches:
	// this process runs it at once, and its step row's lease is its
	// durable record.
	Eager bool
	Reply *outbox.Message
	// HandOff is the outbox rows' publish_after in milliseconds, nil for
	// the relay.
	HandOff any
}

// Recorded is what a Record's statement reports.
type Recorded struct {
	// Led is set when the lead wrote (always for LeadNone).
	Led bool
	// Moved is set when the move applied; Created is then the saga's
	// start, and Dispatched is set when it dispatched its next step.
	Moved, Dispatched bool
	Created           time.Time
	// NextID and ReplyID are the outbox rows written, if any.
	NextID, ReplyID *int64
}

// The statements that record an attempt's outcome, one per lead. Each is
// the lead's CTE (i) followed by recordTail, which reads $1-$37 below;
// the lead's own parameters follow from $38. The parts a record lacks
// (no move, no next step, no reply) are empty inputs, not other texts,
// so each statement has one text and one plan.
//
// The move's next steps, and the commands among them, are arrays: a move
// dispatches a set of steps, one for a line of steps today; steps that
// run in parallel pass several, each with its own row and command.
var (
	recordNone = `with i as (select)` + recordTail

	recordFailure = `with i as (
  update idemsaga.inbox set outcome = $38::text, error = $39::text, result = null
  where saga_id = $1 and step_key = $2 and attempt = $40::int and outcome = 'succeeded'
  returning 1
)` + recordTail

	recordFailureAlone = fmt.Sprintf(`with i as (
  insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome, error)
  select s.id, $2, $41::text, $42::text, $40::int, $38::text, $39::text
  from idemsaga.sagas s
  where s.id = $1 and pg_advisory_xact_lock_shared(%d, $43) is not null
  on conflict (saga_id, step_key) do update set attempt = excluded.attempt, outcome = excluded.outcome, error = excluded.error, result = null
    where x.outcome = 'retry' and x.attempt < excluded.attempt
  returning 1
)`, LockClass) + recordTail

	recordExternal = fmt.Sprintf(`with i as (
  update idemsaga.inbox x set outcome = $38::text, result = $41::jsonb, error = $39::text, unknown = x.unknown or $42::bool
  where x.saga_id = $1 and x.step_key = $2 and x.attempt = $40::int and x.outcome = 'started'
    and pg_advisory_xact_lock_shared(%d, $43) is not null
  returning 1
)`, LockClass) + recordTail
)

// recordTail is the saga's part of every record, gated on its lead (i):
// the saga's update (u), fenced by state and version; the ended step's (f);
// under the orchestrator's lock ($18) the attempt's timeline row (a); the
// next steps' rows (st) and their commands (o); the result kept on the
// inbox row (r) and the reply (rep) where the move did not apply. It
// returns what it did (Recorded) and checks the invariant: under a lock a
// move cannot miss, and a move that applied always finds its step.
//
// $1 saga, $2 step key; the move: $3 to, $4 from, $5 version, $6 finished,
// $7 saga error (NULL: kept), $8 result step (NULL: none), $9 its result,
// $10 there is a move, $11 step status, $12 step result, $13 step error,
// $14 possibly done, $15-$17 step, phase, attempt, $18 locked; the next
// steps: $19-$23 step, phase, index, key, lease (ms) arrays, $24-$28 the
// commands' step, subject, message id, payload, headers arrays; $29 the
// hand-off (ms, NULL: the relay's); $30 keep the result, $31 the result;
// $32-$36 the reply (there is one, subject, message id, payload,
// headers); $37 what the invariant's breach says.
var recordTail = `, u as (
  update idemsaga.sagas set state = $3::text, version = version + 1, updated_at = idemsaga.now(),
    finished_at = case when $6::bool then idemsaga.now() else finished_at end,
    error = coalesce($7::text, error),
    results = case when $8::text is null then results else results || jsonb_build_object($8::text, coalesce($9::jsonb, 'null'::jsonb)) end
  where $10::bool and id = $1 and state = $4::text and version = $5::bigint and exists (select from i)
  returning created_at
), f as (
  update idemsaga.steps set status = $11::text, result = $12::jsonb, last_error = $13::text,
    possibly_done = possibly_done or $14::bool,
    lease_until = null, next_attempt_at = null, updated_at = idemsaga.now()
  where saga_id = $1 and step = $15::text and phase = $16::text and attempt = $17::int
    and (status = 'dispatched' or ($18::bool and status in ('retrying', 'waiting')))
    and exists (select from u)
  returning saga_id, step, phase, attempt
), a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, idemsaga.now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then $11::text else x.outcome end,
    error = coalesce($13::text, x.error)
  from f where $18::bool and x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
), st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select f.saga_id, n.step, n.phase, n.step_index, n.key, 'dispatched', 1, idemsaga.now() + n.lease * interval '1 millisecond', idemsaga.now()
  from f, unnest($19::text[], $20::text[], $21::int[], $22::uuid[], $23::bigint[]) as n(step, phase, step_index, key, lease)
  on conflict (saga_id, step, phase) do nothing
  returning step
), o as (
  ` + outboxInsert(`select c.subject, c.msg_id, c.payload, $1, clock_timestamp() + $29::bigint * interval '1 millisecond', c.headers
  from unnest($24::text[], $25::text[], $26::text[], $27::bytea[], $28::jsonb[]) as c(step, subject, msg_id, payload, headers)
  where c.step in (select step from st)
  returning id`) + `
), r as (
  update idemsaga.inbox set result = $31::jsonb
  where $30::bool and saga_id = $1 and step_key = $2 and exists (select from i) and not exists (select from u)
), rep as (
  ` + outboxInsert(`select $33::text, $34::text, $35::bytea, $1, clock_timestamp() + $29::bigint * interval '1 millisecond', $36::jsonb
  where $32::bool and exists (select from i) and not exists (select from u)
  returning id`) + `
)
select exists (select from i), (select created_at from u), exists (select from st), (select min(id) from o), (select id from rep),
  case when $10::bool and ($18::bool or exists (select from u)) and not (exists (select from u) and exists (select from f))
    then idemsaga.invariant_broken($37::text) end`

// args returns the record's statement and its arguments.
func (r *Record) args(locked bool) (string, []any) {
	args := make([]any, 0, 43)
	args = append(args, pguuid.Of(r.Saga), pguuid.Of(r.Key))
	m := r.Move
	if m == nil {
		args = append(args, nil, nil, nil, false, nil, nil, nil, false, nil, nil, nil, false, nil, nil, nil, locked)
	} else {
		args = append(args, string(m.To), string(m.From), m.Version, m.Finished, nullText(m.Error), nullText(m.ResultStep), nullJSON(m.Result),
			true, string(m.Status), nullJSON(m.StepResult), nullText(m.StepError), m.PossiblyDone, m.Step, string(m.Phase), m.Attempt, locked)
	}
	var steps, phases, cmdSteps, subjects, msgIDs []string
	var indexes []int32
	var keys []pgtype.UUID
	var leases []int64
	var payloads [][]byte
	var headers []*string
	if m != nil && m.Next != nil {
		d := m.Next
		steps, phases, indexes, keys, leases = []string{d.Step}, []string{string(d.Phase)}, []int32{int32(d.Index)}, []pgtype.UUID{pguuid.Of(d.Key)}, []int64{d.LeaseMillis}
		if !r.Eager {
			cmdSteps, subjects, msgIDs, payloads, headers = []string{d.Step}, []string{d.Subject}, []string{d.MsgID}, [][]byte{d.Payload}, []*string{headersText(d.Headers)}
		}
	}
	args = append(args, steps, phases, indexes, keys, leases, cmdSteps, subjects, msgIDs, payloads, headers, r.HandOff)
	// The result of a database step's success that is not applied in its
	// step goes to its inbox row, for a later duplicate's answer.
	keep := r.Lead == LeadNone && len(r.Result) > 0 && (m != nil || r.Reply != nil)
	args = append(args, keep, nullJSON(r.Result))
	if rep := r.Reply; rep != nil {
		args = append(args, true, rep.Subject, rep.MsgID, rep.Payload, HeadersJSON(rep.Headers))
	} else {
		args = append(args, false, nil, nil, nil, nil)
	}
	what := ""
	if m != nil {
		what = fmt.Sprintf("the move of saga %s from %s at version %d to %s missed its step %s (%s) at attempt %d", m.Saga, m.From, m.Version, m.To, m.Step, m.Phase, m.Attempt)
	}
	args = append(args, what)
	switch r.Lead {
	case LeadFailure:
		return recordFailure, append(args, r.InboxOutcome, r.ErrText, r.Attempt)
	case LeadFailureAlone:
		return recordFailureAlone, append(args, r.InboxOutcome, r.ErrText, r.Attempt, r.Step, string(r.Phase), LockID(r.Key))
	case LeadExternal:
		return recordExternal, append(args, r.InboxOutcome, nullText(r.ErrText), r.Attempt, nullJSON(r.Result), r.Unknown, LockID(r.Key))
	}
	return recordNone, args
}

// scan reads what the statement reports into out, and records the outbox
// rows it wrote on tx.
func (r *Record) scan(tx *Tx, out *Recorded) func(pgx.Row) error {
	return func(row pgx.Row) error {
		var created *time.Time
		var invariant *int
		if err := row.Scan(&out.Led, &created, &out.Dispatched, &out.NextID, &out.ReplyID, &invariant); err != nil {
			return fmt.Errorf("record the outcome of step %q (%s) of saga %s at attempt %d: %w", r.Step, r.Phase, r.Saga, r.Attempt, err)
		}
		if created != nil {
			out.Moved, out.Created = true, *created
		}
		if out.NextID != nil {
			d := r.Move.Next
			tx.Sent(outbox.Committed{ID: *out.NextID, Subject: d.Subject, MsgID: d.MsgID, Payload: d.Payload, Headers: d.Headers})
		}
		if out.ReplyID != nil {
			tx.Sent(outbox.Committed{ID: *out.ReplyID, Subject: r.Reply.Subject, MsgID: r.Reply.MsgID, Payload: r.Reply.Payload, Headers: r.Reply.Headers})
		}
		return nil
	}
}

// QueueRecord adds r's statement to tx, an attempt's own transaction; out
// is filled when it is sent.
func QueueRecord(tx *Tx, r *Record, out *Recorded) {
	sql, args := r.args(false)
	tx.Queue(sql, r.scan(tx, out), args...)
}

// QueueMove queues m on tx, a transaction that locked m's saga and read it
// at m.Version (the orchestrator's, a repair's): m's writes cannot miss,
// and a miss fails the transaction as a bug. The step m ends may be
// retrying or waiting, and its attempt's timeline row is closed too.
// handOff is the next command's publish_after in milliseconds, nil for the
// relay. The next command carries tx's trace context (Tx.SetTrace) unless
// it has headers of its own. created, if not nil, receives the saga's
// start once the statement ran.
func QueueMove(tx *Tx, m *Move, handOff any, created *time.Time) {
	if m.Next != nil && m.Next.Headers == nil {
		m.Next.Headers = tx.trace
	}
	r := &Record{Lead: LeadNone, Saga: m.Saga, Step: m.Step, Phase: m.Phase, Attempt: m.Attempt, Move: m, HandOff: handOff}
	out := &Recorded{}
	sql, args := r.args(true)
	scan := r.scan(tx, out)
	tx.Queue(sql, func(row pgx.Row) error {
		if err := scan(row); err != nil {
			return err
		}
		if created != nil {
			*created = out.Created
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

// NullJSON is nullJSON for the engine's own statements' arguments.
func NullJSON(b json.RawMessage) any { return nullJSON(b) }

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

// headersText is HeadersJSON for an array element.
func headersText(h map[string]string) *string {
	if s, ok := HeadersJSON(h).(string); ok {
		return &s
	}
	return nil
}

func nullText(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// NullText passes an empty string as NULL.
func NullText(s string) any { return nullText(s) }
