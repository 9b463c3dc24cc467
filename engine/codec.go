package engine

import (
	"fmt"

	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/saga"
)

// PayloadKey is a key of NewAESGCM's keyring: its ID, kept with every
// value it seals, and its secret of 32 random bytes (AES-256).
type PayloadKey struct {
	ID     string
	Secret []byte
}

// NewAESGCM returns a Codec (Config.Codec) that seals with AES-256-GCM
// under keys[0], bound to the saga, and opens what any of keys sealed.
// To rotate, put a new key first and keep the old ones until every saga
// that holds data sealed with them is deleted by retention (the
// longest-running saga plus --keep-finished); a value whose key is gone
// no longer opens, and its saga's steps fail to start, saying which key
// is missing.
func NewAESGCM(keys ...PayloadKey) (saga.Codec, error) {
	ks := make([]seal.Key, len(keys))
	for i, k := range keys {
		ks[i] = seal.Key{ID: k.ID, Secret: k.Secret}
	}
	c, err := seal.NewAESGCM(ks)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: payload keys: %w", err)
	}
	return c, nil
}
