package payments_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m, payments.Migrate) }

func post(t *testing.T, srv *httptest.Server, path string, key uuid.UUID, body any) (int, map[string]any) {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, srv.URL+path, bytes.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", key.String())
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var out map[string]any
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
	return resp.StatusCode, out
}

// TestChargesAndRefundsAreIdempotentByKey: a key charges once however
// often it is sent, concurrently too; another body under it is refused; a
// refund gives the charge back once; a refund of a key never charged voids
// it, and the charge, arriving late, is refused.
func TestChargesAndRefundsAreIdempotentByKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	svc := payments.New(pool, nil)
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)
	order, key := uuid.New(), uuid.New()
	charge := payments.ChargeRequest{Order: order, Customer: "ann", Amount: 1200}

	statuses := make([]int, 16)
	var wg sync.WaitGroup
	for i := range statuses {
		wg.Go(func() { statuses[i], _ = post(t, srv, "/charges", key, charge) })
	}
	wg.Wait()
	created := 0
	for _, s := range statuses {
		require.Contains(t, []int{http.StatusCreated, http.StatusOK, http.StatusServiceUnavailable}, s)
		if s == http.StatusCreated {
			created++
		}
	}
	require.Equal(t, 1, created, "one charge created")
	status, body := post(t, srv, "/charges", key, charge)
	require.Equal(t, http.StatusOK, status, "the same key again: the first charge")
	require.Equal(t, "charged", body["state"])
	status, _ = post(t, srv, "/charges", key, payments.ChargeRequest{Order: order, Customer: "ann", Amount: 1})
	require.Equal(t, http.StatusUnprocessableEntity, status, "another body under the key")

	refund := payments.RefundRequest{Charge: key, Order: order, Customer: "ann"}
	refundKey := uuid.New()
	for range 3 {
		status, body = post(t, srv, "/refunds", refundKey, refund)
		require.Equal(t, http.StatusOK, status)
		require.Equal(t, "refunded", body["state"])
	}
	status, _ = post(t, srv, "/refunds", refundKey, payments.RefundRequest{Charge: uuid.New(), Order: order, Customer: "ann"})
	require.Equal(t, http.StatusUnprocessableEntity, status, "a refund key reused for another charge")

	// A refund before its charge voids the key.
	late := uuid.New()
	status, body = post(t, srv, "/refunds", uuid.New(), payments.RefundRequest{Charge: late, Order: order, Customer: "bob"})
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, "voided", body["state"])
	status, _ = post(t, srv, "/charges", late, payments.ChargeRequest{Order: order, Customer: "bob", Amount: 500})
	require.Equal(t, http.StatusConflict, status, "a late charge of a voided key is refused")

	var rows, held int64
	require.NoError(t, pool.QueryRow(ctx, `select count(*), coalesce(sum(amount) filter (where state = 'charged'), 0) from payments.charges`).Scan(&rows, &held))
	require.Equal(t, []int64{2, 0}, []int64{rows, held}, "two keys, nothing held after the refund")
	c := svc.Counts()
	require.Equal(t, []int64{1, 2}, []int64{c.Charges, c.Refunds}, "one charge, one refund and one void took effect")
}

// TestFaultsLoseTheAnswerNotTheEffect: with every response lost, the
// charge still commits; the caller sees a broken connection. A 500 and a
// 503 come before anything is charged.
func TestFaultsLoseTheAnswerNotTheEffect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	svc := payments.New(pool, nil)
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)
	charge := func(key uuid.UUID) error {
		b, _ := json.Marshal(payments.ChargeRequest{Order: uuid.New(), Customer: "ann", Amount: 100})
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", bytes.NewReader(b))
		req.Header.Set("Idempotency-Key", key.String())
		resp, err := srv.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	svc.SetFaults(payments.Faults{LoseResponse: 1}, 1)
	lost := uuid.New()
	require.Error(t, charge(lost), "the answer is lost")
	var state string
	require.NoError(t, pool.QueryRow(ctx, `select state from payments.charges where key = $1`, lost).Scan(&state))
	require.Equal(t, "charged", state, "the charge committed")

	for _, f := range []payments.Faults{{FailBefore: 1}, {Busy: 1}} {
		svc.SetFaults(f, 1)
		key := uuid.New()
		require.NoError(t, charge(key))
		var n int
		require.NoError(t, pool.QueryRow(ctx, `select count(*) from payments.charges where key = $1`, key).Scan(&n))
		require.Zero(t, n, "nothing charged: %+v", f)
	}
	c := svc.Counts()
	require.Equal(t, []int64{1, 1, 1, 1}, []int64{c.Charges, c.LostResponses, c.FailedBefore, c.Busy})
}

// TestRateLimitAnswers429BeforeCharging: of a burst of requests over the
// limit, on every route, the bucket admits its capacity (one more if a
// token came back meanwhile); the rest are answered 429 with a
// Retry-After, and none of them charged or refunded anything.
func TestRateLimitAnswers429BeforeCharging(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	svc := payments.New(pool, nil)
	svc.SetFaults(payments.Faults{RateLimit: 5}, 1)
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)

	const n = 20
	keys, reqs := make([]uuid.UUID, n), make([]*http.Request, n)
	for i := range n {
		keys[i] = uuid.New()
		switch i % 4 {
		case 0:
			reqs[i] = newRequest(t, http.MethodGet, srv.URL+"/charges/"+keys[i].String(), uuid.Nil, nil)
		case 1:
			reqs[i] = newRequest(t, http.MethodPost, srv.URL+"/refunds", keys[i], payments.RefundRequest{Charge: uuid.New(), Order: uuid.New(), Customer: "ann"})
		default:
			reqs[i] = newRequest(t, http.MethodPost, srv.URL+"/charges", keys[i], payments.ChargeRequest{Order: uuid.New(), Customer: "ann", Amount: 100})
		}
	}
	statuses, retryAfter := make([]int, n), make([]string, n)
	var wg sync.WaitGroup
	began := time.Now()
	for i, req := range reqs {
		wg.Go(func() {
			resp, err := srv.Client().Do(req)
			if !assert.NoError(t, err) {
				return
			}
			defer resp.Body.Close()
			var body map[string]any
			assert.NoError(t, json.NewDecoder(resp.Body).Decode(&body), "a JSON body")
			statuses[i], retryAfter[i] = resp.StatusCode, resp.Header.Get("Retry-After")
		})
	}
	wg.Wait()
	admitted, limited := 0, 0
	for i, status := range statuses {
		if status != http.StatusTooManyRequests {
			require.Contains(t, []int{http.StatusOK, http.StatusCreated, http.StatusNotFound}, status)
			admitted++
			continue
		}
		limited++
		secs, err := strconv.Atoi(retryAfter[i])
		require.NoError(t, err, "Retry-After is whole seconds")
		require.GreaterOrEqual(t, secs, 1)
		var rows int
		require.NoError(t, pool.QueryRow(ctx, `select (select count(*) from payments.charges where key = $1) + (select count(*) from payments.refunds where key = $1)`, keys[i]).Scan(&rows))
		require.Zero(t, rows, "request %d was answered 429 and wrote nothing", i)
	}
	// The bucket regains 5 tokens a second: a burst that a busy machine
	// stretched admits those too.
	most := 5 + int(math.Ceil(5*time.Since(began).Seconds()))
	require.LessOrEqual(t, admitted, most, "at most the bucket's 5, and the tokens back during the burst")
	require.GreaterOrEqual(t, admitted, 5, "a full bucket admits 5")
	c := svc.Counts()
	require.Equal(t, []int64{n, int64(limited)}, []int64{c.Requests, c.RateLimited})
}

// TestLateChargeIsRefusedAfterItsRefund: a charge that commits late is
// refused if a refund voided its key while it waited, and charged
// otherwise, even when its caller gave up and hung up meanwhile; Close
// stops the wait without charging.
func TestLateChargeIsRefusedAfterItsRefund(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	svc := payments.New(pool, nil)
	svc.SetFaults(payments.Faults{LateCommit: 500 * time.Millisecond, LateCommitP: 1}, 1)
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)

	order, refunded, kept := uuid.New(), uuid.New(), uuid.New()
	statuses := make(map[uuid.UUID]int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, key := range []uuid.UUID{refunded, kept} {
		wg.Go(func() {
			status, _ := post(t, srv, "/charges", key, payments.ChargeRequest{Order: order, Customer: "ann", Amount: 700})
			mu.Lock()
			statuses[key] = status
			mu.Unlock()
		})
	}
	// Both charges reached the service and wait; the refund comes first.
	require.Eventually(t, func() bool { return svc.Counts().Requests == 2 }, 5*time.Second, time.Millisecond)
	status, body := post(t, srv, "/refunds", uuid.New(), payments.RefundRequest{Charge: refunded, Order: order, Customer: "ann"})
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, "voided", body["state"], "the refund came before the charge committed")
	wg.Wait()
	require.Equal(t, http.StatusConflict, statuses[refunded], "the late charge is refused")
	require.Equal(t, http.StatusCreated, statuses[kept], "a late charge without a refund commits")
	require.Equal(t, "voided", chargeState(t, pool, refunded))
	require.Equal(t, "charged", chargeState(t, pool, kept))
	var held int64
	require.NoError(t, pool.QueryRow(ctx, `select coalesce(sum(amount), 0) from payments.charges where state = 'charged'`).Scan(&held))
	require.Equal(t, int64(700), held, "only the kept charge holds money")
	c := svc.Counts()
	require.Equal(t, []int64{1, 1, 1}, []int64{c.Charges, c.LateCharges, c.LateRefused})

	// A caller that gives up does not stop the charge: it commits late.
	done := make(chan struct{})
	gone := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(done)
		svc.Handler().ServeHTTP(w, r)
	}))
	t.Cleanup(gone.Close)
	svc.SetFaults(payments.Faults{LateCommit: 300 * time.Millisecond, LateCommitP: 1}, 1)
	abandoned := uuid.New()
	rctx, cancel := context.WithCancel(ctx)
	req := newRequest(t, http.MethodPost, gone.URL+"/charges", abandoned, payments.ChargeRequest{Order: order, Customer: "ann", Amount: 1})
	go func() {
		defer cancel()
		assert.Eventually(t, func() bool { return svc.Counts().Requests == 4 }, 5*time.Second, time.Millisecond)
	}()
	_, err := gone.Client().Do(req.WithContext(rctx))
	require.ErrorIs(t, err, context.Canceled)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the late charge still waits")
	}
	require.Equal(t, "charged", chargeState(t, pool, abandoned), "charged after its caller left")

	// Close stops the wait: 503, nothing charged.
	closing := uuid.New()
	svc.Close()
	status, _ = post(t, srv, "/charges", closing, payments.ChargeRequest{Order: order, Customer: "ann", Amount: 1})
	require.Equal(t, http.StatusServiceUnavailable, status)
	require.Empty(t, chargeState(t, pool, closing), "nothing charged")
	require.Equal(t, int64(2), svc.Counts().LateCharges)
}

// TestDroppedReusedConnectionIsResentAndMeets503: a charge that commits
// and drops its reused connection is resent by Go's transport on its own
// when the request can be rewound and carries an Idempotency-Key; the
// resent request meets a 503 "nothing was charged" although the charge
// committed. A request that cannot be rewound gets the transport's error
// instead: an unknown outcome, as it is.
func TestDroppedReusedConnectionIsResentAndMeets503(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	svc := payments.New(pool, nil)
	svc.SetFaults(payments.Faults{DropReused: 1}, 1)
	srv := httptest.NewUnstartedServer(svc.Handler())
	srv.Config.ConnContext = svc.ConnContext
	srv.Start()
	t.Cleanup(srv.Close)
	charge := payments.ChargeRequest{Order: uuid.New(), Customer: "ann", Amount: 300}

	// warm returns a client whose one idle connection served a request.
	warm := func() *http.Client {
		client := &http.Client{Transport: &http.Transport{}}
		t.Cleanup(client.CloseIdleConnections)
		resp, err := client.Do(newRequest(t, http.MethodGet, srv.URL+"/charges/"+uuid.New().String(), uuid.Nil, nil))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusNotFound, resp.StatusCode)
		return client
	}

	// bytes.Reader: net/http sets GetBody, and resends.
	resent := uuid.New()
	req := newRequest(t, http.MethodPost, srv.URL+"/charges", resent, charge)
	require.NotNil(t, req.GetBody)
	resp, err := warm().Do(req)
	require.NoError(t, err, "the transport resent the request")
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "the resent request meets the 503")
	require.Equal(t, "charged", chargeState(t, pool, resent), "although the charge committed")

	// A body that cannot be rewound: the caller sees the drop.
	unknown := uuid.New()
	req = newRequest(t, http.MethodPost, srv.URL+"/charges", unknown, charge)
	b, err := io.ReadAll(req.Body)
	require.NoError(t, err)
	req.Body, req.GetBody = io.NopCloser(io.MultiReader(bytes.NewReader(b))), nil
	_, err = warm().Do(req)
	require.Error(t, err, "a transport error: the outcome is unknown")
	require.Equal(t, "charged", chargeState(t, pool, unknown))

	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `select count(*) from payments.charges`).Scan(&rows))
	require.Equal(t, 2, rows, "each key charged once")
	c := svc.Counts()
	require.Equal(t, []int64{2, 2, 1}, []int64{c.Charges, c.DroppedReused, c.BusyAfterDrop})
}

// newRequest builds a request with a JSON body (nil: none) and an
// Idempotency-Key (uuid.Nil: none).
func newRequest(t *testing.T, method, url string, key uuid.UUID, body any) *http.Request {
	t.Helper()
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		require.NoError(t, err)
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, r)
	require.NoError(t, err)
	if key != uuid.Nil {
		req.Header.Set("Idempotency-Key", key.String())
	}
	return req
}

// chargeState returns the state of key's charge row, "" if none.
func chargeState(t *testing.T, pool *pgxpool.Pool, key uuid.UUID) string {
	t.Helper()
	var state string
	err := pool.QueryRow(context.Background(), `select state from payments.charges where key = $1`, key).Scan(&state)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return state
}
