package saga

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
)

// ErrInvalidCallbackToken is returned for a callback token that is not
// one CallbackToken made.
var ErrInvalidCallbackToken = errors.New("idemsaga: invalid callback token")

// CallbackToken returns the token that names step of saga sagaID for the
// other system's callback: the saga's ID and the step's name, the same for
// every attempt, so a callback answers the step whichever attempt sent
// the request. Give it to the other system with the request (in a
// callback URL, or its metadata); it is not a secret: callbacks are
// authenticated as every other request is, and signed when the
// definition asks (WithCallbackSecrets).
func CallbackToken(sagaID uuid.UUID, step string) string {
	return sagaID.String() + "." + step
}

// CallbackToken returns the token of this step for its callback (see the
// package-level CallbackToken).
func (sc *StepContext) CallbackToken() string { return CallbackToken(sc.SagaID, sc.Step) }

// ParseCallbackToken returns the saga ID and step name a callback token
// names. The error wraps ErrInvalidCallbackToken and says what is wrong.
func ParseCallbackToken(token string) (uuid.UUID, string, error) {
	id, step, ok := strings.Cut(token, ".")
	if !ok {
		return uuid.Nil, "", fmt.Errorf("%w %q: want <saga id>.<step>, as StepContext.CallbackToken gives it", ErrInvalidCallbackToken, token)
	}
	sagaID, err := uuid.Parse(id)
	if err != nil || len(id) != 36 {
		return uuid.Nil, "", fmt.Errorf("%w %q: %q is not a saga ID (a UUID)", ErrInvalidCallbackToken, token, id)
	}
	if !namePattern.MatchString(step) {
		return uuid.Nil, "", fmt.Errorf("%w %q: %q is not a step name", ErrInvalidCallbackToken, token, step)
	}
	return sagaID, step, nil
}

// CallbackSignatureHeader is the HTTP header that carries a callback's
// signature (SignCallback) to POST /v1/callbacks/{token}.
const CallbackSignatureHeader = "Idemsaga-Signature"

// ErrCallbackSignature is returned for a callback of a definition with
// signed callbacks whose signature is missing or matches none of its
// secrets. Nothing is written.
var ErrCallbackSignature = errors.New("idemsaga: callback signature missing or not valid")

// WithCallbackSecrets returns a copy of d whose callbacks must be signed:
// each carries SignCallback(secret, body) for one of secrets, over the
// exact body delivered, and one that does not is refused before anything
// is written (ErrCallbackSignature). Several secrets let you rotate: add
// the new one, have the other system sign with it, then drop the old.
// That callbacks are signed is part of the Description; the secrets are
// not, so a process with only the description refuses every callback (send
// them to a process built with d's code). It panics on no secret or an
// empty one.
func WithCallbackSecrets(d *Definition, secrets ...[]byte) *Definition {
	if len(secrets) == 0 {
		panic(fmt.Sprintf("saga: WithCallbackSecrets(%q): give at least one secret", d.name))
	}
	c := *d
	c.signed, c.secrets = true, nil
	for _, s := range secrets {
		if len(s) == 0 {
			panic(fmt.Sprintf("saga: WithCallbackSecrets(%q): a secret is empty", d.name))
		}
		c.secrets = append(c.secrets, bytes.Clone(s))
	}
	return &c
}

// SignedCallbacks reports whether d's callbacks must be signed.
func (d *Definition) SignedCallbacks() bool { return d.signed }

// SignCallback returns the signature of a callback's body under secret,
// as the other system sends it in CallbackSignatureHeader:
// "sha256=" and the hex HMAC-SHA256 of body.
func SignCallback(secret, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// VerifyCallback checks signature over body against d's secrets: nil for
// a definition whose callbacks are not signed, or a signature of one of
// its secrets; otherwise an error wrapping ErrCallbackSignature that says
// what is wrong.
func (d *Definition) VerifyCallback(body []byte, signature string) error {
	switch {
	case !d.signed:
		return nil
	case len(d.secrets) == 0:
		return fmt.Errorf("%w: definition %s signs its callbacks and this process has only its description, not its secrets; deliver callbacks to a process built with its code", ErrCallbackSignature, d.Ref())
	case signature == "":
		return fmt.Errorf("%w: definition %s signs its callbacks: send %s: sha256=<hex HMAC-SHA256 of the body>", ErrCallbackSignature, d.Ref(), CallbackSignatureHeader)
	}
	for _, s := range d.secrets {
		if hmac.Equal([]byte(SignCallback(s, body)), []byte(signature)) {
			return nil
		}
	}
	return fmt.Errorf("%w: it matches none of definition %s's secrets over the body as delivered", ErrCallbackSignature, d.Ref())
}
