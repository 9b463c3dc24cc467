package saga

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

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
	// of the step being compensated.
	Results map[string]json.RawMessage
	// Tx is the transaction in which the engine records this step's inbox
	// entry and reply. Business writes made through it commit together with
	// the dedup record, or not at all. Do not commit or roll it back, nor
	// end it through Tx.Conn(): a handler that does and returns success
	// fails for good.
	Tx pgx.Tx
}

// ExecLast runs sql as the handler's last statement in Tx, and reports
// only whether it failed. In a TxOnly forward step the worker holds it
// back and sends it in the round trip that records the step's success and
// commits, with the inbox claim if nothing went before it: a step whose
// effect is that one statement then costs one round trip, not two.
//
// Its affected row count is never seen, so sql must fail (raise an error)
// whenever the step cannot take effect: a statement that quietly changes
// nothing would commit the step as a success. If a held-back statement
// fails, for any reason, nothing of the attempt commits and the worker
// runs the handler again at once, in a new transaction where ExecLast
// runs at once and returns the statement's error, for the handler to
// judge as any other (saga.Permanent, or a retry). A failure at the commit
// (a deferred constraint, a serialization failure) is not the statement's:
// as for any step, the attempt ends without an outcome and its command is
// delivered again. Elsewhere (a step not
// TxOnly, a compensation, a statement without arguments) it always runs
// at once.
//
// After ExecLast the handler must not use Tx again: that fails, in either
// way, with an error that says so.
func (sc *StepContext) ExecLast(ctx context.Context, sql string, args ...any) error {
	if l, ok := sc.Tx.(interface {
		ExecLast(ctx context.Context, sql string, args ...any) error
	}); ok {
		return l.ExecLast(ctx, sql, args...)
	}
	_, err := sc.Tx.Exec(ctx, sql, args...)
	return err
}

// DecodeInput decodes the saga input into v.
func (sc *StepContext) DecodeInput(v any) error {
	if err := json.Unmarshal(sc.Input, v); err != nil {
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
	if err := json.Unmarshal(raw, v); err != nil {
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
