package store

import (
	"encoding/binary"

	"github.com/google/uuid"
)

// LockClass is the first key of the advisory locks on step keys: a
// transaction that holds a step key (a claim not yet committed, an outcome
// being recorded) holds one shared, so that the engine can tell, without
// waiting on it, that the key is busy (pg_try_advisory_xact_lock). The
// two-key form's space is separate from the one-key form's.
const LockClass = 0x69646d73 // "idms"

// LockID returns the second key of a step key's advisory lock. Two keys
// that share it only make each other look busy a moment longer.
func LockID(key uuid.UUID) int32 { return int32(binary.BigEndian.Uint32(key[12:16])) }
