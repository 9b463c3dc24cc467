package service

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// TestSubmitTokensFromTheCLI: start takes a key with the submit-token
// prefix for a token, as the library and the HTTP API do, and run
// refuses a token time to live out of bounds before it connects.
func TestSubmitTokensFromTheCLI(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)

	_, _, err = runIn(t, shop, "start", "greet", "--key", "st_not-issued", "--input", `{}`)
	require.ErrorIs(t, err, engine.ErrSubmitTokenInvalid)
	require.ErrorContains(t, err, "fetch a new token for greet")

	for _, ttl := range []string{"30s", "25h0m0s", "1m30.5s"} {
		_, _, err = runIn(t, shop, "run", "--submit-token-ttl", ttl)
		require.ErrorContains(t, err, "--submit-token-ttl "+ttl, ttl)
	}
}
