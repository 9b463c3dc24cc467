package saga

import "github.com/google/uuid"

// Codec seals the data a deployment keeps at rest: sagas' inputs, step
// results (in the saga's row, the step's, the inbox's, and in the
// commands and replies in the outbox and the stream) and callback
// results. The engine calls Seal with canonical JSON and stores what it
// returns in an envelope that marks it sealed; it calls Open on that
// when a handler, a condition or a reader needs the JSON. id is the saga
// the data belongs to: bind it (as AEAD associated data, say), so that a
// sealed value copied into another saga does not open. Data stored
// before a deployment had a Codec is read as it is.
//
// The engine's AES-GCM keyring (engine.NewAESGCM) is one; a Codec backed
// by a key service implements the same two methods. Seal and Open are
// called concurrently.
type Codec interface {
	Seal(id uuid.UUID, plain []byte) ([]byte, error)
	Open(id uuid.UUID, sealed []byte) ([]byte, error)
}
