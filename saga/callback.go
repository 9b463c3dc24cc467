package saga

import (
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
// authenticated as every other request is.
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
