package payments_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"

	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/internal/exampleenv"
)

// The payment service charges once per Idempotency-Key: the same request
// sent again is answered with the charge it made.
func Example() {
	infra := exampleenv.New()
	defer infra.Close()
	ctx := context.Background()
	conn, _ := infra.Pool.Acquire(ctx)
	if err := payments.Migrate(ctx, conn.Conn()); err != nil {
		panic(err)
	}
	conn.Release()
	srv := httptest.NewServer(payments.New(infra.Pool, slog.New(slog.NewTextHandler(io.Discard, nil))).Handler())
	defer srv.Close()

	body := `{"order":"0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d","customer":"ann","amount":1500}`
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", bytes.NewBufferString(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "5f0e6a1c-6b8e-5d4a-9f1e-2a3b4c5d6e7f")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode)
	}
	var charges int
	_ = infra.Pool.QueryRow(ctx, `select count(*) from payments.charges`).Scan(&charges)
	fmt.Println(charges, "charge")
	// Output:
	// 201
	// 200
	// 1 charge
}
