package engine

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/saga"
)

// SubmitTokenPrefix begins every submit token, and reserves the keys that
// begin with it: Start takes a key with this prefix for a submit token,
// and refuses it unless IssueToken issued it for that definition and it
// has not expired. Other keys never touch the tokens.
const SubmitTokenPrefix = "st_"

// Time-to-live bounds of a submit token.
const (
	// SubmitTokenTTLDefault is the time to live of a token issued with a
	// ttl of 0.
	SubmitTokenTTLDefault = time.Hour
	// MinSubmitTokenTTL is the shortest time to live IssueToken accepts.
	MinSubmitTokenTTL = time.Minute
	// MaxSubmitTokenTTL is the longest time to live IssueToken accepts.
	MaxSubmitTokenTTL = 24 * time.Hour
)

// submitTokenBytes is the randomness of a token: 256 bits, unguessable.
const submitTokenBytes = 32

// ErrSubmitTokenInvalid is returned by Start and StartTx for a key with
// SubmitTokenPrefix that cannot start a saga of the definition: never
// issued, issued for another definition, or expired. Nothing was written;
// the caller fetches a new token (IssueToken) and submits with it. A token
// that already started a saga is not invalid: submitted again, it answers
// with that saga like any key.
var ErrSubmitTokenInvalid = errors.New("idemsaga: submit token not valid")

// SubmitToken is a one-time saga key issued by the server: the first Start
// that carries it as its key consumes it, in the transaction that creates
// the saga.
type SubmitToken struct {
	// Token is the key to start the saga with: SubmitTokenPrefix and 43
	// characters of unpadded base64url.
	Token string
	// Definition is the definition the token starts a saga of.
	Definition string
	// ExpiresAt is when the token stops being accepted if unused, on the
	// database clock.
	ExpiresAt time.Time
}

// IsSubmitToken reports whether key has the form of a submit token, that
// is, whether Start treats it as one.
func IsSubmitToken(key string) bool { return strings.HasPrefix(key, SubmitTokenPrefix) }

// IssueToken issues a submit token for a saga of def that lives for ttl
// (0: SubmitTokenTTLDefault; at least MinSubmitTokenTTL, at most
// MaxSubmitTokenTTL). Hand it to whoever will submit (a form, say): the
// first Start of def with the token as its key consumes it and starts the
// saga, and every later Start with it and the same input answers with
// that saga, as with any key. A token not used before it expires is
// refused with ErrSubmitTokenInvalid, and deleted by the engine's cleaner.
func (cl *Client) IssueToken(ctx context.Context, def *saga.Definition, ttl time.Duration) (SubmitToken, error) {
	return cl.issueToken(ctx, cl.c.Pool(), def, ttl)
}

// IssueTokenTx is IssueToken inside the caller's transaction: the token
// exists if and only if the transaction commits.
func (cl *Client) IssueTokenTx(ctx context.Context, tx pgx.Tx, def *saga.Definition, ttl time.Duration) (SubmitToken, error) {
	return cl.issueToken(ctx, tx, def, ttl)
}

func (cl *Client) issueToken(ctx context.Context, q store.Row, def *saga.Definition, ttl time.Duration) (SubmitToken, error) {
	if def == nil {
		return SubmitToken{}, errors.New("idemsaga: issue submit token: definition is nil")
	}
	if ttl == 0 {
		ttl = SubmitTokenTTLDefault
	}
	if ttl < MinSubmitTokenTTL || ttl > MaxSubmitTokenTTL {
		return SubmitToken{}, fmt.Errorf("idemsaga: issue submit token: a time to live of %s is outside %s to %s; give one within, or 0 for %s",
			ttl, MinSubmitTokenTTL, MaxSubmitTokenTTL, SubmitTokenTTLDefault)
	}
	if _, err := cl.c.Resolve(ctx, def.Name()); err != nil {
		return SubmitToken{}, err
	}
	b := make([]byte, submitTokenBytes)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	tok := SubmitToken{Token: SubmitTokenPrefix + base64.RawURLEncoding.EncodeToString(b), Definition: def.Name()}
	if err := q.QueryRow(ctx, cl.c.Schema().SQL(store.InsertSubmitToken), tok.Token, tok.Definition, ttl.Milliseconds()).Scan(&tok.ExpiresAt); err != nil {
		return SubmitToken{}, fmt.Errorf("idemsaga: issue submit token for %q: %w", def.Name(), err)
	}
	return tok, nil
}

// explainSubmitToken returns the ErrSubmitTokenInvalid of a token that
// started no saga of definition, saying why.
func explainSubmitToken(ctx context.Context, q store.Row, schema *pgschema.Schema, definition, token string) error {
	var (
		issuedFor         string
		expiresAt         time.Time
		consumed, expired bool
		fetch             = fmt.Sprintf("fetch a new token for %s and submit with it", definition)
	)
	err := q.QueryRow(ctx, schema.SQL(store.SelectSubmitToken), token).Scan(&issuedFor, &expiresAt, &consumed, &expired)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %q was not issued by this deployment, or it expired and was deleted; nothing was written: %s", ErrSubmitTokenInvalid, token, fetch)
	case err != nil:
		return fmt.Errorf("idemsaga: start saga %q: read submit token: %w", definition, err)
	case issuedFor != definition:
		return fmt.Errorf("%w: %q was issued for a saga of %s, not of %s; nothing was written: %s", ErrSubmitTokenInvalid, token, issuedFor, definition, fetch)
	case consumed:
		// Its saga is gone: finished and deleted past the replay window
		// (RetentionConfig.FinishedSagas), which can be shorter than the
		// token's life.
		return fmt.Errorf("%w: %q was used already, by a saga since deleted past the replay window; nothing was written: %s", ErrSubmitTokenInvalid, token, fetch)
	case expired:
		return fmt.Errorf("%w: %q expired at %s unused; nothing was written: %s", ErrSubmitTokenInvalid, token, expiresAt.UTC().Format(time.RFC3339), fetch)
	default:
		// Unused and live by this read's clock, which can be later than the
		// start's: it expired as it was submitted.
		return fmt.Errorf("%w: %q expired at %s, as it was submitted; nothing was written: %s", ErrSubmitTokenInvalid, token, expiresAt.UTC().Format(time.RFC3339), fetch)
	}
}
