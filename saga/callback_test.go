package saga_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func TestCallbackTokenRoundTrips(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7())
	sc := &saga.StepContext{SagaID: id, Step: "charge"}
	token := sc.CallbackToken()
	require.Equal(t, saga.CallbackToken(id, "charge"), token)
	gotID, gotStep, err := saga.ParseCallbackToken(token)
	require.NoError(t, err)
	require.Equal(t, id, gotID)
	require.Equal(t, "charge", gotStep)
}

func TestParseCallbackTokenRefusesOthers(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7()).String()
	for _, bad := range []string{"", "charge", id, id + ".", "x." + "charge", id + ".char ge", id + "./x", "{" + id + "}.charge",
		"urn:uuid:" + id + ".charge", id + "." + string(make([]byte, 65))} {
		_, _, err := saga.ParseCallbackToken(bad)
		require.ErrorIs(t, err, saga.ErrInvalidCallbackToken, "%q", bad)
	}
}

func FuzzParseCallbackToken(f *testing.F) {
	f.Add(saga.CallbackToken(uuid.Must(uuid.NewV7()), "charge"))
	f.Add("x.y")
	f.Fuzz(func(t *testing.T, s string) {
		id, step, err := saga.ParseCallbackToken(s)
		if err != nil {
			return
		}
		// What parses is exactly what CallbackToken makes.
		require.Equal(t, s, saga.CallbackToken(id, step))
	})
}

func TestCallbackStepWait(t *testing.T) {
	t.Parallel()
	noop := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	d, err := saga.New("cb", saga.Step{Name: "pay", Reaches: "paid", Kind: saga.CallbackStep, Forward: noop})
	require.NoError(t, err)
	require.Equal(t, saga.CallbackWaitDefault, d.Step(0).Wait)
	require.Equal(t, "callback", d.Step(0).Kind.String())

	_, err = saga.New("cb", saga.Step{Name: "pay", Reaches: "paid", Kind: saga.ExternalStep, Forward: noop, Wait: time.Minute})
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.ErrorContains(t, err, "only a saga.CallbackStep or a saga.ChildStep waits")
	for _, w := range []time.Duration{time.Millisecond, -time.Second, saga.CallbackWaitMax + time.Second} {
		_, err = saga.New("cb", saga.Step{Name: "pay", Reaches: "paid", Kind: saga.CallbackStep, Forward: noop, Wait: w})
		require.ErrorIs(t, err, saga.ErrInvalidDefinition, "%s", w)
	}

	// The description keeps the kind and the wait.
	d, err = saga.New("cb", saga.Step{Name: "pay", Reaches: "paid", Kind: saga.CallbackStep, Forward: noop, Wait: 90 * time.Minute})
	require.NoError(t, err)
	back, err := saga.FromDescription(d.Describe())
	require.NoError(t, err)
	require.Equal(t, saga.CallbackStep, back.Step(0).Kind)
	require.Equal(t, 90*time.Minute, back.Step(0).Wait)
	require.Equal(t, d.Describe().Fingerprint(), back.Describe().Fingerprint())
}

// TestCallbackSignatures: a signature of any of a definition's secrets
// over the body checks; another body, secret or none does not; a
// definition rebuilt from its description knows its callbacks are signed
// and, without the secrets, refuses every one.
func TestCallbackSignatures(t *testing.T) {
	t.Parallel()
	noop := func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }
	plain := saga.MustNew("pay", saga.Step{Name: "ask", Reaches: "asked", Kind: saga.CallbackStep, Forward: noop})
	def := saga.WithCallbackSecrets(plain, []byte("a"), []byte("b"))
	body := []byte(`{"event_id":"e","result":1}`)
	require.NoError(t, plain.VerifyCallback(body, ""), "unsigned definitions check nothing")
	require.NoError(t, def.VerifyCallback(body, saga.SignCallback([]byte("a"), body)))
	require.NoError(t, def.VerifyCallback(body, saga.SignCallback([]byte("b"), body)))
	for _, s := range []string{"", saga.SignCallback([]byte("c"), body), saga.SignCallback([]byte("a"), []byte(`{}`)), "sha256="} {
		require.ErrorIs(t, def.VerifyCallback(body, s), saga.ErrCallbackSignature, s)
	}
	require.True(t, def.Describe().SignedCallbacks)
	require.NotEqual(t, plain.Describe().Fingerprint(), def.Describe().Fingerprint())
	require.NotContains(t, def.Describe().Fingerprint(), "a\"", "the secrets are not described")
	rebuilt, err := saga.FromDescription(def.Describe())
	require.NoError(t, err)
	require.True(t, rebuilt.SignedCallbacks())
	require.ErrorIs(t, rebuilt.VerifyCallback(body, saga.SignCallback([]byte("a"), body)), saga.ErrCallbackSignature)
	require.Panics(t, func() { saga.WithCallbackSecrets(plain) })
	require.Panics(t, func() { saga.WithCallbackSecrets(plain, []byte{}) })
}
