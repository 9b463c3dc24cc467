package httpapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// verdict is what the database decided about a request's Idempotency-Key.
type verdict int

const (
	// verdictOwned: this request holds the key's claim and must answer,
	// recording its answer with complete or giving the claim back with
	// release.
	verdictOwned verdict = iota
	// verdictReplay: an earlier request with this key and body completed;
	// its answer is in claim.answer.
	verdictReplay
	// verdictMismatch: the key was first used with another body.
	verdictMismatch
	// verdictInFlight: an earlier request with this key and body is still
	// being handled.
	verdictInFlight
)

// claimRounds bounds how often a claim is retried when the row it read
// changed before it could act on it (released, completed or taken over by
// a concurrent request). Each round reads what the other request did, so
// this is reached only under sustained churn on one key; the answer is then
// 409, which a client retries.
const claimRounds = 5

// answer is a stored response.
type answer struct {
	status      int
	body        []byte
	contentType string
	location    string
}

// claim is the outcome of keyStore.claim.
type claim struct {
	verdict verdict
	// token fences the claim when verdict is verdictOwned.
	token uuid.UUID
	// tookOver is true when an abandoned or expired row was replaced.
	tookOver bool
	// answer is the stored response when verdict is verdictReplay.
	answer answer
}

// keyStore adjudicates Idempotency-Keys in PostgreSQL. Every decision is a
// single statement: an insert that does nothing on conflict, or an update
// conditional on the claim token read. Nothing is decided by reading and
// then writing in Go.
type keyStore struct {
	pool         *pgxpool.Pool
	ttl          time.Duration
	claimTimeout time.Duration
}

func micros(d time.Duration) int64 { return d.Microseconds() }

// claim takes the key for a request whose body hashes to hash, or tells
// why it cannot.
func (s *keyStore) claim(ctx context.Context, key string, hash []byte) (claim, error) {
	token, err := uuid.NewRandom()
	if err != nil {
		return claim{}, fmt.Errorf("claim idempotency key: new token: %w", err)
	}
	for range claimRounds {
		tag, err := s.pool.Exec(ctx, claimKey, key, hash, token, micros(s.ttl))
		if err != nil {
			return claim{}, fmt.Errorf("claim idempotency key %q: %w", key, err)
		}
		if tag.RowsAffected() == 1 {
			return claim{verdict: verdictOwned, token: token}, nil
		}

		var (
			storedHash                []byte
			held                      uuid.UUID
			status                    *int32
			a                         answer
			completed, stale, expired bool
		)
		err = s.pool.QueryRow(ctx, readKey, key, micros(s.claimTimeout)).Scan(
			&storedHash, &held, &status, &a.body, &a.contentType, &a.location, &completed, &stale, &expired)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // released since our insert: claim again
		}
		if err != nil {
			return claim{}, fmt.Errorf("read idempotency key %q: %w", key, err)
		}
		same := bytes.Equal(storedHash, hash)
		switch {
		case expired || (!completed && stale && same):
			tag, err := s.pool.Exec(ctx, takeOverKey, key, held, hash, token, micros(s.ttl), micros(s.claimTimeout))
			if err != nil {
				return claim{}, fmt.Errorf("take over idempotency key %q: %w", key, err)
			}
			if tag.RowsAffected() == 1 {
				return claim{verdict: verdictOwned, token: token, tookOver: true}, nil
			}
			continue // completed or taken over meanwhile: read again
		case !same:
			return claim{verdict: verdictMismatch}, nil
		case completed:
			if status == nil {
				return claim{}, fmt.Errorf("idempotency key %q is completed without a status", key)
			}
			a.status = int(*status)
			return claim{verdict: verdictReplay, answer: a}, nil
		default:
			return claim{verdict: verdictInFlight}, nil
		}
	}
	return claim{verdict: verdictInFlight}, nil
}

// complete records the answer of the claim token holds, inside tx (the
// transaction that starts the saga). It reports false when the claim was
// taken over meanwhile: the caller must then roll tx back.
func (s *keyStore) complete(ctx context.Context, tx pgx.Tx, key string, token uuid.UUID, a answer) (bool, error) {
	tag, err := tx.Exec(ctx, completeKey, key, token, a.status, a.body, a.contentType, a.location, micros(s.ttl))
	if err != nil {
		return false, fmt.Errorf("record the answer for idempotency key %q: %w", key, err)
	}
	return tag.RowsAffected() == 1, nil
}

// release gives an unanswered claim back, so that a retry is handled at
// once. A claim that was completed or taken over is left alone. It runs
// even when ctx is cancelled, with its own deadline; if it fails, the
// claim goes stale after Config.ClaimTimeout and is taken over.
func (s *keyStore) release(ctx context.Context, key string, token uuid.UUID) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := s.pool.Exec(ctx, releaseKey, key, token); err != nil {
		return fmt.Errorf("release idempotency key %q: %w", key, err)
	}
	return nil
}
