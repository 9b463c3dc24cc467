package store

import (
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
	// Skip names the conditional steps the move skipped, added to the
	// saga's (saga.Instance.Skipped).
	Skip []string

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
	// First says the ended step's row was never written: the first
	// attempt of a saga's first step, run in the transaction that starts
	// the saga (FirstStep). The move writes that row once, in its final
	// form, instead of updating it. Only a success's move in the step's
	// own transaction has it.
	First bool

	// Next, if set, is the step this move dispatches, at attempt 1.
	Next *Dispatch
	// Also are the branches of a parallel group the move dispatches
	// beside Next. Only a move under the saga's lock (QueueMove) has
	// them.
	Also []*Dispatch
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
	// Resolved, for LeadExternal, says the step's Verify answered about
	// the key (done, or not done: Verified): the doubt of the attempts
	// before is closed (Unknown is then false).
	Resolved, Verified bool
	Result             json.RawMessage
	ErrText            string

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

// The statements that record an attempt's outcome: for each lead in the
// attempt's own transaction, and under the saga's lock (QueueMove), one
// statement per set of parts the record has (a move, a next step, its
// command, a kept result, a reply), all written at start from the parts
// below with named parameters (@name) numbered once (compile). A part a
// record lacks is left out of its statement rather than given empty
// inputs: the executor would open its table and every index of it for
// nothing, which costs the server more than the rows do.
var statements = func() map[shape]named {
	all := map[shape]named{}
	for _, lead := range []Lead{LeadNone, LeadFailure, LeadFailureAlone, LeadExternal} {
		for bits := 0; bits < 1<<5; bits++ {
			sh := shape{lead: lead, move: bits&1 != 0, next: bits&2 != 0, command: bits&4 != 0, keep: bits&8 != 0, reply: bits&16 != 0}
			if sh.valid() {
				all[sh] = compile(sh.text())
			}
			if lk := sh; sh.valid() && lead == LeadNone && !sh.keep && !sh.reply && sh.move {
				lk.locked = true
				all[lk] = compile(lk.text())
			}
			if fs := sh; sh.valid() && lead == LeadNone && !sh.reply && sh.move {
				fs.first = true
				all[fs] = compile(fs.text())
			}
		}
	}
	return all
}()

// shape is which parts a record's statement has.
type shape struct {
	lead Lead
	// locked: under the saga's lock, the attempt's timeline row is closed
	// too, and a miss is a bug.
	locked bool
	// first: the ended step's row is inserted in its final form (Move.First).
	first                            bool
	move, next, command, keep, reply bool
}

// valid reports a shape a record can have: a next step needs a move, a
// command a next step, and only a success's lead keeps a result, where a
// move may miss or a reply goes.
func (sh shape) valid() bool {
	return (sh.move || !sh.next) && (sh.next || !sh.command) && (!sh.keep || sh.lead == LeadNone && (sh.move || sh.reply))
}

// text writes the statement of shape sh from its parts.
func (sh shape) text() string {
	var ctes []string
	if sh.lead != LeadNone {
		ctes = append(ctes, leads[sh.lead])
	}
	if sh.move {
		ended := endedPart
		if sh.first {
			ended = firstPart
		}
		ctes = append(ctes, sagaPart, ended)
		if sh.locked {
			ctes = append(ctes, timelinePart)
		}
	}
	if sh.next {
		ctes = append(ctes, stepPart)
	}
	if sh.command {
		ctes = append(ctes, commandPart)
	}
	if sh.keep {
		ctes = append(ctes, keepPart)
	}
	if sh.reply {
		ctes = append(ctes, replyPart)
	}
	// The markers say what the parts depend on: the lead's write (none to
	// wait for without a lead), the move's miss (always, without a move),
	// the statuses the ended step may be in (under the saga's lock, also
	// retrying or waiting).
	r := []string{"{lead_wrote}", "exists (select from i)", "{and_lead_wrote}", " and exists (select from i)",
		"{and_not_moved}", " and not exists (select from u)", "{step_statuses}", "'dispatched'"}
	if sh.lead == LeadNone {
		r[1], r[3] = "true", ""
	}
	if !sh.move {
		r[5] = ""
	}
	if sh.locked {
		r[7] = "'dispatched', 'retrying', 'waiting'"
	}
	text := report(sh)
	if len(ctes) > 0 {
		text = "with " + strings.Join(ctes, ",\n") + "\n" + text
	}
	return strings.NewReplacer(r...).Replace(text)
}

// leads are the leads' parts (i): one row when the lead wrote. LeadNone
// writes nothing, and its statements have no such part.
var leads = map[Lead]string{LeadFailure: leadFailure, LeadFailureAlone: leadFailureAlone, LeadExternal: leadExternal}

// The leads.
var (
	leadFailure = `i as (
  update idemsaga.inbox set outcome = @inbox_outcome::text, error = @inbox_error::text, result = null
  where saga_id = @saga and step_key = @key and attempt = @attempt::int and outcome = 'succeeded'
  returning 1
)`

	leadFailureAlone = fmt.Sprintf(`i as (
  insert into idemsaga.inbox as x (saga_id, step_key, step, phase, attempt, outcome, error)
  select s.id, @key, @step::text, @phase::text, @attempt::int, @inbox_outcome::text, @inbox_error::text
  from idemsaga.sagas s
  where s.id = @saga and pg_advisory_xact_lock_shared(%d, @lock) is not null
  on conflict (saga_id, step_key) do update set attempt = excluded.attempt, outcome = excluded.outcome, error = excluded.error, result = null
    where x.outcome = 'retry' and x.attempt < excluded.attempt
  returning 1
)`, LockClass)

	leadExternal = fmt.Sprintf(`i as (
  update idemsaga.inbox x set outcome = @inbox_outcome::text, result = @inbox_result::jsonb, error = @inbox_error::text,
    unknown = not @resolved::bool and (x.unknown or @unknown::bool),
    verified = @verified::bool or x.verified and not @unknown::bool
  where x.saga_id = @saga and x.step_key = @key and x.attempt = @attempt::int and x.outcome = 'started'
    and pg_advisory_xact_lock_shared(%d, @lock) is not null
  returning 1
)`, LockClass)
)

// sagaPart is the move's update of the saga (u), gated on the lead and
// fenced by state and version.
const sagaPart = `u as (
  update idemsaga.sagas set state = @to::text, version = version + 1, updated_at = idemsaga.now(),
    finished_at = case when @finished::bool then idemsaga.now() else finished_at end,
    error = coalesce(@saga_error::text, error),
    results = case when @result_step::text is null then results
      else results || jsonb_build_object(@result_step::text, coalesce(@saga_result::jsonb, 'null'::jsonb)) end,
    skipped = case when @skip::text[] is null then skipped else skipped || @skip::text[] end
  where id = @saga and state = @from::text and version = @version::bigint{and_lead_wrote}
  returning created_at
)`

// endedPart is the move's update of the ended step (f), in the statuses
// it may end from ({step_statuses}, set when the statement is written).
const endedPart = `f as (
  update idemsaga.steps set status = @status::text, result = @step_result::jsonb, last_error = @step_error::text,
    possibly_done = possibly_done or @possibly_done::bool,
    lease_until = null, next_attempt_at = null, updated_at = idemsaga.now()
  where saga_id = @saga and step = @move_step::text and phase = @move_phase::text and attempt = @move_attempt::int
    and status in ({step_statuses})
    and exists (select from u)
  returning saga_id, step, phase, attempt
)`

// firstPart writes the ended step's row (f) in its final form, where a
// move ends the first attempt of a saga's first step (index 0, as the
// start writes it) that ran in the start's transaction (Move.First).
const firstPart = `f as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, result, last_error, possibly_done, dispatched_at)
  select @saga, @move_step::text, @move_phase::text, 0, @key, @status::text, @move_attempt::int, @step_result::jsonb, @step_error::text,
    @possibly_done::bool, idemsaga.now()
  where exists (select from u)
  returning saga_id, step, phase, attempt
)`

// timelinePart closes the ended attempt's timeline row (a), if it has one:
// under the saga's lock, an attempt the reaper or a repair touched.
const timelinePart = `a as (
  update idemsaga.step_attempts x set finished_at = coalesce(x.finished_at, idemsaga.now()),
    outcome = case when x.outcome is null or x.outcome = 'retry' then @status::text else x.outcome end,
    error = coalesce(@step_error::text, x.error)
  from f where x.saga_id = f.saga_id and x.step = f.step and x.phase = f.phase and x.attempt = f.attempt
)`

// stepPart is the next step's row (st), if there is one.
const stepPart = `st as (
  insert into idemsaga.steps (saga_id, step, phase, step_index, key, status, attempt, lease_until, dispatched_at)
  select f.saga_id, @next_step::text, @next_phase::text, @next_index::int, @next_key::uuid, 'dispatched', 1,
    idemsaga.now() + @next_lease::bigint * interval '1 millisecond', idemsaga.now()
  from f
  on conflict (saga_id, step, phase) do nothing
  returning saga_id
)`

// commandPart is the next step's command (o), if its row went in.
var commandPart = `o as (
  ` + outboxInsert(`select @cmd_subject::text, @cmd_msg_id::text, @cmd_payload::bytea, saga_id,
    clock_timestamp() + @hand_off::bigint * interval '1 millisecond', @cmd_headers::jsonb
  from st`) + `
  returning id
)`

// keepPart keeps a database step's result on its inbox row (r) where the
// move did not apply, for a later duplicate's answer.
const keepPart = `r as (
  update idemsaga.inbox set result = @inbox_result::jsonb
  where saga_id = @saga and step_key = @key{and_lead_wrote}{and_not_moved}
)`

// replyPart is the reply (rep), where the move did not apply: the
// orchestrator then decides.
var replyPart = `rep as (
  ` + outboxInsert(`select @reply_subject::text, @reply_msg_id::text, @reply_payload::bytea, @saga,
    clock_timestamp() + @hand_off::bigint * interval '1 millisecond', @reply_headers::jsonb
  where true{and_lead_wrote}{and_not_moved}`) + `
  returning id
)`

// report is what a statement of shape sh returns: whether the lead wrote,
// the saga's start when the move applied, whether it dispatched, the
// command's and the reply's outbox ids, and the invariant: a move that
// applied always finds its step, and under the saga's lock a move cannot
// miss.
func report(sh shape) string {
	created, dispatched, cmd, rep, check := "null::timestamptz", "false", "null::bigint", "null::bigint", "null::int"
	if sh.move {
		created = "(select created_at from u)"
		missed := "exists (select from u) and not exists (select from f)"
		if sh.locked {
			missed = "not exists (select from u) or not exists (select from f)"
		}
		check = "case when " + missed + " then idemsaga.invariant_broken(@invariant::text) end"
	}
	if sh.next {
		dispatched = "exists (select from st)"
	}
	if sh.command {
		cmd = "(select id from o)"
	}
	if sh.reply {
		rep = "(select id from rep)"
	}
	return "select {lead_wrote}, " + created + ", " + dispatched + ", " + cmd + ", " + rep + ",\n  " + check
}

// named is a statement written with @name parameters, numbered once, with
// how to read each parameter's value from a record.
type named struct {
	sql    string
	params []param
}

// param reads one parameter of a record's statement. A statement holds a
// part only when the record has it, so a move's, a next step's, a
// command's or a reply's parameter finds it there.
type param func(r *Record) any

// compile numbers a statement's @name parameters in the order they first
// appear (every use of a name is the same parameter) and takes each one's
// reader from params; a name without one is a bug, found at start.
func compile(text string) named {
	var n named
	index := map[string]int{}
	var b strings.Builder
	for i := 0; i < len(text); i++ {
		if text[i] != '@' {
			b.WriteByte(text[i])
			continue
		}
		j := i + 1
		for j < len(text) && (text[j] == '_' || text[j] >= 'a' && text[j] <= 'z') {
			j++
		}
		name := text[i+1 : j]
		k, ok := index[name]
		if !ok {
			p, known := params[name]
			if !known {
				panic("store: a record statement names @" + name + ", which no parameter reads")
			}
			n.params = append(n.params, p)
			k = len(n.params)
			index[name] = k
		}
		b.WriteString("$" + strconv.Itoa(k))
		i = j - 1
	}
	n.sql = b.String()
	return n
}

// params are the readers of the record statements' parameters, by name.
var params = map[string]param{
	"saga":          func(r *Record) any { return pguuid.Of(r.Saga) },
	"key":           func(r *Record) any { return pguuid.Of(r.Key) },
	"step":          func(r *Record) any { return r.Step },
	"phase":         func(r *Record) any { return string(r.Phase) },
	"attempt":       func(r *Record) any { return r.Attempt },
	"lock":          func(r *Record) any { return LockID(r.Key) },
	"inbox_outcome": func(r *Record) any { return r.InboxOutcome },
	"inbox_error": func(r *Record) any {
		if r.Lead == LeadExternal {
			return nullText(r.ErrText)
		}
		return r.ErrText
	},
	"inbox_result": func(r *Record) any { return nullJSON(r.Result) },
	"unknown":      func(r *Record) any { return r.Unknown },
	"verified":     func(r *Record) any { return r.Verified },
	"resolved":     func(r *Record) any { return r.Resolved },
	"hand_off":     func(r *Record) any { return r.HandOff },

	"to":          func(r *Record) any { return string(r.Move.To) },
	"from":        func(r *Record) any { return string(r.Move.From) },
	"version":     func(r *Record) any { return r.Move.Version },
	"finished":    func(r *Record) any { return r.Move.Finished },
	"saga_error":  func(r *Record) any { return nullText(r.Move.Error) },
	"result_step": func(r *Record) any { return nullText(r.Move.ResultStep) },
	"saga_result": func(r *Record) any { return nullJSON(r.Move.Result) },
	"skip": func(r *Record) any {
		if len(r.Move.Skip) == 0 {
			return nil
		}
		return r.Move.Skip
	},
	"status":        func(r *Record) any { return string(r.Move.Status) },
	"step_result":   func(r *Record) any { return nullJSON(r.Move.StepResult) },
	"step_error":    func(r *Record) any { return nullText(r.Move.StepError) },
	"possibly_done": func(r *Record) any { return r.Move.PossiblyDone },
	"move_step":     func(r *Record) any { return r.Move.Step },
	"move_phase":    func(r *Record) any { return string(r.Move.Phase) },
	"move_attempt":  func(r *Record) any { return r.Move.Attempt },
	"invariant": func(r *Record) any {
		m := r.Move
		return fmt.Sprintf("the move of saga %s from %s at version %d to %s missed its step %s (%s) at attempt %d", m.Saga, m.From, m.Version, m.To, m.Step, m.Phase, m.Attempt)
	},

	"next_step":  func(r *Record) any { return r.Move.Next.Step },
	"next_phase": func(r *Record) any { return string(r.Move.Next.Phase) },
	"next_index": func(r *Record) any { return r.Move.Next.Index },
	"next_key":   func(r *Record) any { return pguuid.Of(r.Move.Next.Key) },
	"next_lease": func(r *Record) any { return r.Move.Next.LeaseMillis },

	"cmd_subject": func(r *Record) any { return r.Move.Next.Subject },
	"cmd_msg_id":  func(r *Record) any { return r.Move.Next.MsgID },
	"cmd_payload": func(r *Record) any { return r.Move.Next.Payload },
	"cmd_headers": func(r *Record) any { return HeadersJSON(r.Move.Next.Headers) },

	"reply_subject": func(r *Record) any { return r.Reply.Subject },
	"reply_msg_id":  func(r *Record) any { return r.Reply.MsgID },
	"reply_payload": func(r *Record) any { return r.Reply.Payload },
	"reply_headers": func(r *Record) any { return HeadersJSON(r.Reply.Headers) },
}

// statement returns the record's statement and its arguments.
func (r *Record) statement(locked bool) (string, []any) {
	m := r.Move
	sh := shape{lead: r.Lead, locked: locked, move: m != nil, reply: r.Reply != nil && !locked, first: m != nil && m.First}
	sh.next = m != nil && m.Next != nil
	// A next step run here at once has no command: its row is its durable
	// record.
	sh.command = sh.next && !r.Eager
	// The result of a database step's success that is not applied in its
	// step goes to its inbox row, for a later duplicate's answer.
	sh.keep = !locked && r.Lead == LeadNone && len(r.Result) > 0 && (m != nil || r.Reply != nil)
	st, ok := statements[sh]
	if !ok {
		panic(fmt.Sprintf("store: no statement of shape %+v", sh)) // a record the engine never builds
	}
	args := make([]any, len(st.params))
	for i, p := range st.params {
		args[i] = p(r)
	}
	return st.sql, args
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
	if r.Move != nil && len(r.Move.Also) > 0 {
		panic("store: a move that dispatches several branches is applied under the saga's lock (QueueMove) only")
	}
	sql, args := r.statement(false)
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
	sql, args := r.statement(true)
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
	QueueBranches(tx, m.Saga, m.Also, handOff)
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
