// Package startlock is the HTTP API's seam into a start: a start whose
// context it marks takes an advisory lock on its (definition, key) without
// waiting, in the transaction that inserts the saga, and is refused with
// ErrHeld when another start holds it. The mark travels in the context,
// as package testhook's hooks do, so that the engine's public Start keeps
// its one meaning for every other caller.
package startlock

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
)

// ErrHeld is the error of a marked start whose key another start holds:
// nothing was written.
var ErrHeld = errors.New("another start of this key holds it right now")

type ctxKey struct{}

// With marks ctx: a start under it tries its key's lock.
func With(ctx context.Context) context.Context { return context.WithValue(ctx, ctxKey{}, true) }

// Without is ctx unmarked, for work a marked start goes on to (the first
// step's handler) whose own starts must not try a lock.
func Without(ctx context.Context) context.Context {
	if marked, _ := ctx.Value(ctxKey{}).(bool); !marked {
		return ctx
	}
	return context.WithValue(ctx, ctxKey{}, false)
}

// Arg returns the start statement's lock parameter for a start of
// (definition, key) under ctx: the lock's ID when ctx is marked, else nil
// (no lock).
func Arg(ctx context.Context, definition, key string) any {
	if marked, _ := ctx.Value(ctxKey{}).(bool); !marked {
		return nil
	}
	return ID(definition, key)
}

// ID is the 64-bit advisory lock of (definition, key): the first 8 bytes
// of its SHA-256, in the one-key form's space.
func ID(definition, key string) int64 {
	sum := sha256.Sum256([]byte(definition + "\x00" + key))
	return int64(binary.BigEndian.Uint64(sum[:8]))
}
