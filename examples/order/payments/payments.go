// Package payments is the order example's payment service: a small HTTP
// API over a table of its own, idempotent by the Idempotency-Key header,
// with faults a test or a chaos run can switch on (Faults): a response
// lost after the charge committed, a 500 or a 503 before charging, an
// answer slower than the caller waits, a charge that commits after the
// caller gave up, a reused connection dropped after the charge committed,
// and a rate limit.
//
//	POST /charges  {"order":"<uuid>","customer":"ann","amount":1200,"callback":"<token>"}
//	    201 charged, 200 the same key again, 402 declined (a customer named
//	    "declined-…"), 409 voided (a refund of the key came first), 422 the
//	    key reused with another body, 503 not charged: try again. A charge
//	    with a callback token is confirmed by callback too (SetNotifier):
//	    twice, as payment channels do, and sometimes before the charge is
//	    answered.
//	POST /refunds  {"charge":"<charge key>","order":"<uuid>","customer":"ann"}
//	    200 {"state":"refunded"|"voided"}: the charge is given back, or
//	    voided if it never came (a late charge is then refused); 422 the
//	    key reused with another charge.
//	GET /charges/{key}
//
// Any route may answer 429 with a Retry-After header (Faults.RateLimit),
// before it reads the key.
//
// Faults.DropReused needs to know which requests come on a connection
// that served one before: mount Handler on an http.Server whose
// ConnContext is Service.ConnContext, or that fault never fires.
//
//	srv := &http.Server{Handler: svc.Handler(), ConnContext: svc.ConnContext}
//
// It is another system than the engine: the order saga reaches it only
// over HTTP, and it shares nothing but the database server in the example.
package payments

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/migrations"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered .sql files of the tables, in its
// migrations folder (for service.Migration and sagatest).
var Migrations fs.FS = migrationFiles

// Schema holds the service's table.
const Schema = "payments"

// Migrate creates or updates the service's table.
func Migrate(ctx context.Context, conn *pgx.Conn) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	return migrations.Apply(ctx, conn, Schema, sub)
}

// Faults make the service misbehave as real ones do. Probabilities are in
// [0, 1]; the zero value behaves.
type Faults struct {
	// LoseResponse commits a charge or a refund, then drops the
	// connection without answering: the caller cannot know it happened.
	LoseResponse float64
	// AlwaysLoseFor lists customers whose charges always lose their
	// response, on every attempt.
	AlwaysLoseFor []string
	// FailBefore answers 500 before charging anything.
	FailBefore float64
	// Busy answers 503 before charging anything: "not charged, try
	// again", as the API documents.
	Busy float64
	// Slow commits, then answers only after this long (0: never slow),
	// with probability SlowP.
	Slow  time.Duration
	SlowP float64
	// Refunds get the faults too when set; otherwise refunds behave.
	Refunds bool
	// ConfirmEarly is the fraction of charges whose first confirmation
	// is sent before the charge is answered (the callback races the
	// answer).
	ConfirmEarly float64
	// LoseConfirmation is the fraction of confirmations lost on their
	// way: the service believes it delivered them.
	LoseConfirmation float64
	// RateLimit admits at most this many requests a second across every
	// caller and route (0: no limit), as a token bucket that holds
	// RateLimit tokens and regains RateLimit a second. A request over it
	// is answered 429 with a Retry-After, before anything is read or
	// charged.
	RateLimit int
	// LateCommit makes a charge wait this long before it commits (0:
	// never late), with probability LateCommitP: the caller's attempt
	// times out while the charge is still on its way, and a refund of
	// the key meanwhile voids it, so that it is refused (409) when it
	// arrives. It commits even if its caller hung up meanwhile; Close
	// stops the wait, uncommitted.
	LateCommit  time.Duration
	LateCommitP float64
	// DropReused is the fraction of charges arriving on a connection
	// that served a request before (see Service.ConnContext) that
	// commit, then drop the connection unanswered: the condition under
	// which Go's http.Transport resends a request carrying an
	// Idempotency-Key on its own. The next charge request under the key
	// is then answered 503 "nothing was charged", before the key is
	// looked at, as a proxy in front of a busy service would: that is
	// what the resent request meets.
	DropReused float64
}

// Notice is a charge's confirmation, sent to the Callback token the
// charge request gave.
type Notice struct {
	Token string
	// EventID is the service's transaction number for the charge: the
	// same in every confirmation of it.
	EventID string
	Charge  Confirmation
}

// Confirmation is what a confirmation says of a charge.
type Confirmation struct {
	Txn    string    `json:"txn"`
	Key    uuid.UUID `json:"key"`
	Amount int64     `json:"amount"`
}

// NotifyFunc delivers one confirmation; an error makes the service send
// it again later.
type NotifyFunc func(ctx context.Context, n Notice) error

// Confirmations is how many times the service confirms each charge (a
// payment channel's retries, whether or not the first was heard).
const Confirmations = 2

// confirmRetryFor bounds how long the service keeps resending a
// confirmation that fails.
const confirmRetryFor = time.Minute

// Counts is what the service saw.
type Counts struct {
	Charges, Refunds, LostResponses, FailedBefore, Busy, Slow, Replays int64
	// Confirmed counts confirmations delivered, ConfirmFailures the
	// deliveries that failed (and were sent again), ConfirmationsLost
	// those lost on purpose (Faults.LoseConfirmation).
	Confirmed, ConfirmFailures, ConfirmationsLost int64
	// Requests counts the requests that reached a route, admitted or
	// not; RateLimited those answered 429 (Faults.RateLimit).
	Requests, RateLimited int64
	// LateCharges counts the charges committed after Faults.LateCommit;
	// LateRefused the late ones refused because a refund had voided
	// their key meanwhile.
	LateCharges, LateRefused int64
	// DroppedReused counts the charges committed whose connection was
	// then dropped (Faults.DropReused); BusyAfterDrop the requests under
	// their keys answered 503 after it.
	DroppedReused, BusyAfterDrop int64
}

// Service is the payment API.
type Service struct {
	pool *pgxpool.Pool
	log  *slog.Logger

	mu     sync.Mutex
	faults Faults
	rng    *rand.Rand
	// tokens admits requests under Faults.RateLimit.
	tokens bucket
	// dropped holds the keys of the charges whose connection was dropped
	// (Faults.DropReused) until a request under the key meets its 503.
	dropped map[uuid.UUID]struct{}

	charges, refunds, lost, failed, busy, slow, replays atomic.Int64
	confirmed, confirmFailed, confirmLost               atomic.Int64
	requests, rateLimited, lateCharges, lateRefused     atomic.Int64
	droppedReused, busyAfterDrop                        atomic.Int64

	notify NotifyFunc
	// notices are the confirmations being sent; Close stops and waits.
	notices sync.WaitGroup
	stop    chan struct{}
	closed  sync.Once
}

// New returns the service over pool's payments schema (Migrate first).
func New(pool *pgxpool.Pool, log *slog.Logger) *Service {
	if log == nil {
		log = slog.Default()
	}
	return &Service{pool: pool, log: log, rng: rand.New(rand.NewPCG(1, 2)), dropped: map[uuid.UUID]struct{}{}, stop: make(chan struct{})}
}

// SetNotifier makes the service confirm each charge that carries a
// callback token through fn. Call it before serving.
func (s *Service) SetNotifier(fn NotifyFunc) { s.notify = fn }

// Close stops sending confirmations and waits for those under way.
func (s *Service) Close() {
	s.closed.Do(func() { close(s.stop) })
	s.notices.Wait()
}

// confirm sends a charge's confirmations: the first one now when early
// (before the charge is answered), the rest in the background, each
// resent until it is delivered or confirmRetryFor passed; those the roll
// drops are lost on the way.
func (s *Service) confirm(token string, c Charge, f roll) {
	if s.notify == nil || token == "" {
		return
	}
	n := Notice{Token: token, EventID: "txn-" + c.Key.String(), Charge: Confirmation{Txn: "txn-" + c.Key.String(), Key: c.Key, Amount: c.Amount}}
	for i, lost := range f.drop {
		switch {
		case lost:
			s.confirmLost.Add(1)
		case i == 0 && f.early:
			s.deliver(n, false)
		default:
			s.notices.Add(1)
			go func() {
				defer s.notices.Done()
				s.deliver(n, true)
			}()
		}
	}
}

func (s *Service) deliver(n Notice, retry bool) {
	deadline := time.Now().Add(confirmRetryFor)
	for delay := 50 * time.Millisecond; ; delay = min(2*delay, 2*time.Second) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := s.notify(ctx, n)
		cancel()
		if err == nil {
			s.confirmed.Add(1)
			return
		}
		s.confirmFailed.Add(1)
		s.log.Debug("payments: confirmation not delivered; sending it again", "event_id", n.EventID, "error", err)
		if !retry || time.Now().Add(delay).After(deadline) {
			if retry {
				s.log.Warn("payments: gave up a confirmation", "event_id", n.EventID, "error", err)
			}
			return
		}
		select {
		case <-s.stop:
			return
		case <-time.After(delay):
		}
	}
}

// SetFaults replaces the faults, seeding their dice; the rate limit's
// bucket starts full.
func (s *Service) SetFaults(f Faults, seed uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults, s.rng = f, rand.New(rand.NewPCG(seed, 7))
	s.tokens = bucket{rate: float64(f.RateLimit), tokens: float64(f.RateLimit), at: time.Now()}
}

// Counts returns what the service saw so far.
func (s *Service) Counts() Counts {
	return Counts{Charges: s.charges.Load(), Refunds: s.refunds.Load(), LostResponses: s.lost.Load(),
		FailedBefore: s.failed.Load(), Busy: s.busy.Load(), Slow: s.slow.Load(), Replays: s.replays.Load(),
		Confirmed: s.confirmed.Load(), ConfirmFailures: s.confirmFailed.Load(), ConfirmationsLost: s.confirmLost.Load(),
		Requests: s.requests.Load(), RateLimited: s.rateLimited.Load(), LateCharges: s.lateCharges.Load(), LateRefused: s.lateRefused.Load(),
		DroppedReused: s.droppedReused.Load(), BusyAfterDrop: s.busyAfterDrop.Load()}
}

// roll draws the faults of one request.
type roll struct {
	lose, failBefore, busy, early bool
	// drop says, per confirmation, whether it is lost.
	drop [Confirmations]bool
	slow time.Duration
	// late delays a charge's commit; dropReused drops its connection
	// after the commit if the connection served a request before.
	late       time.Duration
	dropReused bool
}

func (s *Service) roll(customer string, refund bool) roll {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.faults
	if refund && !f.Refunds {
		return roll{}
	}
	r := roll{
		lose:       s.rng.Float64() < f.LoseResponse,
		failBefore: s.rng.Float64() < f.FailBefore,
		busy:       s.rng.Float64() < f.Busy,
		early:      s.rng.Float64() < f.ConfirmEarly,
	}
	for i := range r.drop {
		r.drop[i] = s.rng.Float64() < f.LoseConfirmation
	}
	if f.Slow > 0 && s.rng.Float64() < f.SlowP {
		r.slow = f.Slow
	}
	if !refund {
		for _, c := range f.AlwaysLoseFor {
			if c == customer {
				r.lose = true
			}
		}
		if f.LateCommit > 0 && s.rng.Float64() < f.LateCommitP {
			r.late = f.LateCommit
		}
		if f.DropReused > 0 {
			r.dropReused = s.rng.Float64() < f.DropReused
		}
	}
	return r
}

// Handler returns the HTTP API. Mount it on an http.Server whose
// ConnContext is s.ConnContext for Faults.DropReused to fire.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", s.admit(s.postCharge))
	mux.HandleFunc("POST /refunds", s.admit(s.postRefund))
	mux.HandleFunc("GET /charges/{key}", s.admit(s.getCharge))
	return mux
}

// servedKey is the context key of a connection's count of requests.
type servedKey struct{}

// ConnContext gives each connection a count of the requests it served,
// by which Faults.DropReused knows a reused connection: set it as the
// ConnContext of the http.Server that serves Handler.
func (s *Service) ConnContext(ctx context.Context, _ net.Conn) context.Context {
	return context.WithValue(ctx, servedKey{}, new(atomic.Int64))
}

// reused reports whether r came on a connection that served a request
// before it (false without ConnContext). An HTTP/1 connection serves its
// requests one at a time, so the count includes r and no later one.
func reused(r *http.Request) bool {
	n, ok := r.Context().Value(servedKey{}).(*atomic.Int64)
	return ok && n.Load() > 1
}

// admit counts a request on its connection and answers it 429 when the
// rate limit has no token for it, before h reads anything.
func (s *Service) admit(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.requests.Add(1)
		if n, ok := r.Context().Value(servedKey{}).(*atomic.Int64); ok {
			n.Add(1)
		}
		if wait, ok := s.take(); !ok {
			s.rateLimited.Add(1)
			secs := max(1, int(math.Ceil(wait.Seconds())))
			w.Header().Set("Retry-After", strconv.Itoa(secs))
			answer(w, http.StatusTooManyRequests, map[string]string{"error": fmt.Sprintf("rate limited: nothing was done; try again in %d s", secs)})
			return
		}
		h(w, r)
	}
}

// take takes a token from the rate limit's bucket, or says how long
// until the next one; without a limit it always admits.
func (s *Service) take() (time.Duration, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.faults.RateLimit <= 0 {
		return 0, true
	}
	return s.tokens.take(time.Now())
}

// bucket is a token bucket: it holds at most rate tokens, and regains
// rate of them a second.
type bucket struct {
	rate, tokens float64
	// at is when tokens was last brought up to date.
	at time.Time
}

// take takes a token at now, or says how long until the next one comes.
func (b *bucket) take(now time.Time) (time.Duration, bool) {
	b.tokens = min(b.rate, b.tokens+now.Sub(b.at).Seconds()*b.rate)
	b.at = now
	if b.tokens >= 1 {
		b.tokens--
		return 0, true
	}
	return time.Duration((1 - b.tokens) / b.rate * float64(time.Second)), false
}

// forgetDropped reports whether key's charge had its connection dropped
// and no request under it met the 503 since, and forgets the key.
func (s *Service) forgetDropped(key uuid.UUID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.dropped[key]
	delete(s.dropped, key)
	return ok
}

// ChargeRequest is the body of POST /charges.
type ChargeRequest struct {
	Order    uuid.UUID `json:"order"`
	Customer string    `json:"customer"`
	Amount   int64     `json:"amount"`
	// Callback, if set, is the token the service's confirmations carry.
	Callback string `json:"callback,omitempty"`
}

// Charge is a charge as the service answers it.
type Charge struct {
	Key    uuid.UUID `json:"key"`
	Order  uuid.UUID `json:"order"`
	Amount int64     `json:"amount"`
	State  string    `json:"state"`
}

// RefundRequest is the body of POST /refunds.
type RefundRequest struct {
	Charge   uuid.UUID `json:"charge"`
	Order    uuid.UUID `json:"order"`
	Customer string    `json:"customer"`
}

// Refund is a refund as the service answers it: the charge's state after
// it, refunded or voided.
type Refund struct {
	Charge uuid.UUID `json:"charge"`
	State  string    `json:"state"`
}

func (s *Service) postCharge(w http.ResponseWriter, r *http.Request) {
	key, req, ok := decode[ChargeRequest](w, r)
	if !ok {
		return
	}
	if s.forgetDropped(key) {
		// A proxy's 503, about this request, not the key.
		s.busyAfterDrop.Add(1)
		answer(w, http.StatusServiceUnavailable, map[string]string{"error": "busy: nothing was charged; try again"})
		return
	}
	if req.Amount <= 0 || req.Customer == "" || req.Order == uuid.Nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": "order, customer and a positive amount are required"})
		return
	}
	f := s.roll(req.Customer, false)
	switch {
	case f.busy:
		s.busy.Add(1)
		answer(w, http.StatusServiceUnavailable, map[string]string{"error": "busy: nothing was charged; try again"})
		return
	case f.failBefore:
		s.failed.Add(1)
		answer(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
		return
	case strings.HasPrefix(req.Customer, "declined-"):
		answer(w, http.StatusPaymentRequired, map[string]string{"error": "card declined"})
		return
	}
	ctx := r.Context()
	if f.late > 0 {
		// The charge goes on after its caller gave up and hung up, as a
		// request already inside a real service does.
		ctx = context.WithoutCancel(ctx)
		select {
		case <-time.After(f.late):
		case <-s.stop:
			answer(w, http.StatusServiceUnavailable, map[string]string{"error": "closing: nothing was charged; try again"})
			return
		}
	}
	var c Charge
	var inserted bool
	var customer string
	err := s.pool.QueryRow(ctx, `with i as (
  insert into payments.charges (key, order_id, customer, amount, state, charged_at)
  values ($1, $2, $3, $4, 'charged', now())
  on conflict (key) do nothing
  returning key, order_id, customer, amount, state
)
select key, order_id, customer, amount, state, true from i
union all
select key, order_id, customer, amount, state, false from payments.charges where key = $1 and not exists (select 1 from i)`,
		key, req.Order, req.Customer, req.Amount).Scan(&c.Key, &c.Order, &customer, &c.Amount, &c.State, &inserted)
	if errors.Is(err, pgx.ErrNoRows) {
		// The key's row committed while this insert waited for it: the
		// caller retries, and finds it.
		answer(w, http.StatusServiceUnavailable, map[string]string{"error": "a request with this key is in flight; nothing was charged by this one; try again"})
		return
	}
	if err != nil {
		s.log.Error("payments: charge", "error", err)
		answer(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
		return
	}
	status := http.StatusCreated
	switch {
	case !inserted && (c.Order != req.Order || customer != req.Customer || c.State != "voided" && c.Amount != req.Amount):
		answer(w, http.StatusUnprocessableEntity, map[string]string{"error": "Idempotency-Key already used for another charge"})
		return
	case c.State == "voided":
		if f.late > 0 {
			s.lateRefused.Add(1)
		}
		answer(w, http.StatusConflict, map[string]string{"error": "voided: this key was refunded before it was charged; nothing was charged"})
		return
	case !inserted:
		s.replays.Add(1)
		status = http.StatusOK
	default:
		s.charges.Add(1)
		if f.late > 0 {
			s.lateCharges.Add(1)
		}
	}
	s.confirm(req.Callback, c, f)
	if f.dropReused && reused(r) {
		s.mu.Lock()
		s.dropped[key] = struct{}{}
		s.mu.Unlock()
		s.droppedReused.Add(1)
		// The charge committed; the connection closes unanswered, and
		// the next request under the key meets a 503.
		panic(http.ErrAbortHandler)
	}
	s.respond(w, f, status, c)
}

func (s *Service) postRefund(w http.ResponseWriter, r *http.Request) {
	key, req, ok := decode[RefundRequest](w, r)
	if !ok {
		return
	}
	if req.Charge == uuid.Nil || req.Order == uuid.Nil || req.Customer == "" {
		answer(w, http.StatusBadRequest, map[string]string{"error": "charge, order and customer are required"})
		return
	}
	f := s.roll(req.Customer, true)
	switch {
	case f.busy:
		s.busy.Add(1)
		answer(w, http.StatusServiceUnavailable, map[string]string{"error": "busy: nothing was refunded; try again"})
		return
	case f.failBefore:
		s.failed.Add(1)
		answer(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
		return
	}
	var res Refund
	err := pgx.BeginFunc(r.Context(), s.pool, func(tx pgx.Tx) error {
		var charge uuid.UUID
		err := tx.QueryRow(r.Context(), `with i as (
  insert into payments.refunds (key, charge_key) values ($1, $2) on conflict (key) do nothing returning charge_key
)
select charge_key from i union all select charge_key from payments.refunds where key = $1 and not exists (select 1 from i)`, key, req.Charge).Scan(&charge)
		if err != nil {
			return err
		}
		if charge != req.Charge {
			return errKeyReused
		}
		// A charge is given back; a key never charged is voided, so a
		// late charge under it is refused.
		res.Charge = req.Charge
		err = tx.QueryRow(r.Context(), `insert into payments.charges (key, order_id, customer, amount, state, refunded_at)
values ($1, $2, $3, 0, 'voided', now())
on conflict (key) do update set state = 'refunded', refunded_at = now() where payments.charges.state = 'charged'
returning state`, req.Charge, req.Order, req.Customer).Scan(&res.State)
		if errors.Is(err, pgx.ErrNoRows) {
			// Refunded or voided already: say what it is.
			s.replays.Add(1)
			return tx.QueryRow(r.Context(), `select state from payments.charges where key = $1`, req.Charge).Scan(&res.State)
		}
		if err == nil {
			s.refunds.Add(1)
		}
		return err
	})
	switch {
	case errors.Is(err, errKeyReused):
		answer(w, http.StatusUnprocessableEntity, map[string]string{"error": "Idempotency-Key already used for another refund"})
		return
	case err != nil:
		s.log.Error("payments: refund", "error", err)
		answer(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
		return
	}
	s.respond(w, f, http.StatusOK, res)
}

var errKeyReused = errors.New("idempotency key reused")

func (s *Service) getCharge(w http.ResponseWriter, r *http.Request) {
	key, err := uuid.Parse(r.PathValue("key"))
	if err != nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": "not a charge key"})
		return
	}
	var c Charge
	err = s.pool.QueryRow(r.Context(), `select key, order_id, amount, state from payments.charges where key = $1`, key).Scan(&c.Key, &c.Order, &c.Amount, &c.State)
	if errors.Is(err, pgx.ErrNoRows) {
		answer(w, http.StatusNotFound, map[string]string{"error": "no charge under this key"})
		return
	}
	if err != nil {
		answer(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
		return
	}
	answer(w, http.StatusOK, c)
}

// respond answers a request whose effect committed, with the faults
// drawn: the answer lost, or late.
func (s *Service) respond(w http.ResponseWriter, f roll, status int, body any) {
	if f.slow > 0 {
		s.slow.Add(1)
		time.Sleep(f.slow)
	}
	if f.lose {
		s.lost.Add(1)
		// The effect committed; the caller hears nothing but a closed
		// connection.
		panic(http.ErrAbortHandler)
	}
	answer(w, status, body)
}

// decode reads the Idempotency-Key and a JSON body, strictly.
func decode[T any](w http.ResponseWriter, r *http.Request) (uuid.UUID, T, bool) {
	var v T
	key, err := uuid.Parse(r.Header.Get("Idempotency-Key"))
	if err != nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": "the Idempotency-Key header must be a UUID"})
		return key, v, false
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		answer(w, http.StatusBadRequest, map[string]string{"error": fmt.Sprintf("bad body: %v", err)})
		return key, v, false
	}
	return key, v, true
}

func answer(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}
