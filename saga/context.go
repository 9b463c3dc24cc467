package saga

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"

	jsonv2 "github.com/go-json-experiment/json"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Tx is the transaction a DatabaseStep's handler writes through: the one in
// which the engine records the step key in the inbox and commits the step's
// outcome, so the handler's writes commit with the dedup record, or not at
// all. It holds the methods a handler needs (sqlc's DBTX is a subset, and a
// pgx.Tx satisfies it), and none that end the transaction: the engine ends
// it, with a commit when the handler returns nil and a rollback otherwise.
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error)
}

// StepContext is what a handler knows about the step it runs. The engine
// builds it for each attempt; handlers must not keep it after they return.
type StepContext struct {
	// SagaID identifies the saga.
	SagaID uuid.UUID
	// Definition is the saga definition's name.
	Definition string
	// Step is the step's name.
	Step string
	// Phase is PhaseForward or PhaseCompensate.
	Phase Phase
	// Key is the step key: UUIDv5 over (SagaID, Step, Phase), the same for
	// every attempt. Pass it downstream as an idempotency key.
	Key uuid.UUID
	// Attempt counts from 1.
	Attempt int
	// Input is the saga's input, as given to Start.
	Input json.RawMessage
	// Results holds the results of the forward steps completed before this
	// one, by step name. In the compensate phase it also holds the result
	// of the step being compensated, when that step is known to have
	// succeeded.
	Results map[string]json.RawMessage
	// ForwardKey is set in the compensate phase: the key the forward phase
	// ran under, which names what to undo at the other system.
	ForwardKey uuid.UUID
	// ForwardUnknown is set in the compensate phase of a step that is
	// possibly done: some attempt of its forward phase had an unknown
	// outcome, so it may or may not have taken effect, and Results holds
	// no result for it. The compensation must undo by ForwardKey, and do
	// no harm when the forward phase never happened.
	ForwardUnknown bool
	// Tx is the step's transaction in a DatabaseStep (see Tx); nil in an
	// ExternalStep, which holds no transaction while it runs.
	Tx Tx
	// Lease is the attempt's hold on its step in an ExternalStep or a
	// CallbackStep (see Heartbeat); nil in a DatabaseStep, whose
	// transaction holds its key.
	Lease Lease
}

// Lease is an external or callback step attempt's hold on its step: the
// engine sets it in the StepContext. A test may set its own.
type Lease interface {
	// Extend restarts the attempt's lease and its time (the step's
	// Retry.Timeout) from now. It returns an error wrapping ErrLeaseLost
	// when the attempt no longer holds the step.
	Extend(ctx context.Context) error
}

// Heartbeat tells the engine that a long call is making progress: the
// attempt's lease and its time (the step's Retry.Timeout, which bounds
// ctx) start again from now, so the step is not taken over while the
// call runs, and a worker that dies is still found within a lease. Call
// it more often than the step's Timeout, for example after each poll of
// a long job. It returns an error wrapping ErrLeaseLost when a later
// attempt took the step over or the engine gave it up: stop, and return;
// nothing this attempt returns is recorded then. In a DatabaseStep it
// does nothing and returns nil.
func (sc *StepContext) Heartbeat(ctx context.Context) error {
	if sc.Lease == nil {
		return nil
	}
	return sc.Lease.Extend(ctx)
}

// DecodeInput decodes the saga input into v. Member names match v's
// fields exactly, case included (unlike encoding/json), so a handler
// reads the input a gateway checked and nothing else.
func (sc *StepContext) DecodeInput(v any) error {
	if err := jsonv2.Unmarshal(sc.Input, v, forHandlers); err != nil {
		return Permanent(fmt.Errorf("decode input of saga %s (%s): %w", sc.SagaID, sc.Definition, err))
	}
	return nil
}

// DecodeResult decodes the result of an earlier forward step into v. It
// reports false when that step left no result.
func (sc *StepContext) DecodeResult(step string, v any) (bool, error) {
	raw, ok := sc.Results[step]
	if !ok || len(raw) == 0 || string(raw) == "null" {
		return false, nil
	}
	if err := jsonv2.Unmarshal(raw, v, forHandlers); err != nil {
		return false, Permanent(fmt.Errorf("decode result of step %q of saga %s: %w", step, sc.SagaID, err))
	}
	return true, nil
}

// Handle adapts a typed function to a HandlerFunc: the saga input is decoded
// into In (a decoding failure is permanent) and the returned Out is encoded
// as the step's result.
func Handle[In, Out any](fn func(ctx context.Context, sc *StepContext, in In) (Out, error)) HandlerFunc {
	return func(ctx context.Context, sc *StepContext) (json.RawMessage, error) {
		var in In
		if err := sc.DecodeInput(&in); err != nil {
			return nil, err
		}
		out, err := fn(ctx, sc, in)
		if err != nil {
			return nil, err
		}
		raw, err := json.Marshal(out)
		if err != nil {
			return nil, Permanent(fmt.Errorf("encode result of step %q: %w", sc.Step, err))
		}
		return raw, nil
	}
}

// CanonicalInput encodes v as canonical JSON: object keys sorted, no
// insignificant whitespace, numbers kept as written. Two inputs that mean
// the same thing encode the same, so their hashes match.
func CanonicalInput(v any) (json.RawMessage, error) {
	var raw []byte
	switch x := v.(type) {
	case json.RawMessage:
		raw = x
	case []byte:
		raw = x
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return nil, fmt.Errorf("idemsaga: encode saga input: %w", err)
		}
		raw = b
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return nil, fmt.Errorf("idemsaga: saga input is not valid JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("idemsaga: saga input has trailing data after the JSON value")
	}
	out, err := json.Marshal(tree)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: encode saga input: %w", err)
	}
	return out, nil
}
