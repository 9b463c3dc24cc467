package pguuid_test

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pguuid"
)

func TestOf(t *testing.T) {
	u := uuid.New()
	p := pguuid.Of(u)
	require.True(t, p.Valid)
	require.Equal(t, [16]byte(u), p.Bytes)
	require.False(t, pguuid.OrNull(uuid.Nil).Valid)
	require.True(t, pguuid.OrNull(u).Valid)
}
