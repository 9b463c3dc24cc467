// Package seal keeps sagas' data sealed at rest with a deployment's
// saga.Codec: a sealed value is a JSON string (so that it fits every
// jsonb column and command member a plain value does), opened where a
// handler, a condition or a reader needs the JSON.
package seal

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/saga"
)

// prefix starts the JSON string of a sealed value.
const prefix = `"idemsaga:sealed:`

// ErrOpen is a sealed value the codec could not open: a key missing from
// its keyring, or data that is not what was sealed.
var ErrOpen = errors.New("idemsaga: a sealed saga value could not be opened")

// Sealer seals and opens values with a codec; a nil Sealer, or one
// without a codec, leaves them as they are.
type Sealer struct{ codec saga.Codec }

// New returns the sealer of codec (nil: none).
func New(codec saga.Codec) *Sealer { return &Sealer{codec: codec} }

// On reports whether values are sealed.
func (s *Sealer) On() bool { return s != nil && s.codec != nil }

// Seal returns plain (JSON) sealed for saga id, as a JSON string; plain
// when there is no codec, or for an empty value.
func (s *Sealer) Seal(id uuid.UUID, plain json.RawMessage) (json.RawMessage, error) {
	if !s.On() || len(plain) == 0 || Sealed(plain) {
		return plain, nil
	}
	out, err := s.codec.Seal(id, plain)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: seal a value of saga %s: %w", id, err)
	}
	b := make([]byte, 0, len(prefix)+base64.RawStdEncoding.EncodedLen(len(out))+1)
	b = append(b, prefix...)
	b = base64.RawStdEncoding.AppendEncode(b, out)
	return append(b, '"'), nil
}

// Sealed reports whether v is a sealed value.
func Sealed(v json.RawMessage) bool { return bytes.HasPrefix(v, []byte(prefix)) }

// Open returns v opened for saga id: the JSON sealed in it, or v itself
// when it is not sealed (data from before the deployment had a codec).
func (s *Sealer) Open(id uuid.UUID, v json.RawMessage) (json.RawMessage, error) {
	if !Sealed(v) {
		return v, nil
	}
	if !s.On() {
		return nil, fmt.Errorf("%w: saga %s holds data sealed by a codec this process does not have; give it the deployment's payload keys (Config.Codec, --payload-keys-file)", ErrOpen, id)
	}
	if len(v) < len(prefix)+1 || v[len(v)-1] != '"' {
		return nil, fmt.Errorf("%w: saga %s: the envelope is cut short", ErrOpen, id)
	}
	raw, err := base64.RawStdEncoding.DecodeString(string(v[len(prefix) : len(v)-1]))
	if err != nil {
		return nil, fmt.Errorf("%w: saga %s: the envelope is not base64: %v", ErrOpen, id, err)
	}
	plain, err := s.codec.Open(id, raw)
	if err != nil {
		return nil, fmt.Errorf("%w: saga %s: %w", ErrOpen, id, err)
	}
	return plain, nil
}

// OpenAll returns a copy of m with each value opened for saga id; m
// itself without a codec.
func (s *Sealer) OpenAll(id uuid.UUID, m map[string]json.RawMessage) (map[string]json.RawMessage, error) {
	if m == nil || !s.On() {
		return m, nil // nothing sealed can open: m as it is, not a copy
	}
	out := make(map[string]json.RawMessage, len(m))
	for k, v := range m {
		o, err := s.Open(id, v)
		if err != nil {
			return nil, fmt.Errorf("result of step %q: %w", k, err)
		}
		out[k] = o
	}
	return out, nil
}

// OpenInstance opens sg's data in place: its input, its results, its
// steps' and callbacks' results. Without a codec it leaves them sealed
// (a process without the keys shows them as they are).
func (s *Sealer) OpenInstance(sg *saga.Instance) error {
	if !s.On() {
		return nil
	}
	var err error
	if sg.Input, err = s.Open(sg.ID, sg.Input); err != nil {
		return err
	}
	if sg.Results, err = s.OpenAll(sg.ID, sg.Results); err != nil {
		return err
	}
	for i := range sg.Steps {
		if sg.Steps[i].Result, err = s.Open(sg.ID, sg.Steps[i].Result); err != nil {
			return err
		}
	}
	for i := range sg.Callbacks {
		if sg.Callbacks[i].Result, err = s.Open(sg.ID, sg.Callbacks[i].Result); err != nil {
			return err
		}
	}
	return nil
}
