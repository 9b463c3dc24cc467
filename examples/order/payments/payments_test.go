package payments_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/google/uuid"
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
