package httpapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// payoutInput is the test saga's input.
type payoutInput struct {
	Account int64 `json:"account"`
	Amount  int64 `json:"amount"`
}

func (in payoutInput) validate() error {
	switch {
	case in.Account <= 0:
		return errors.New("account must be a positive account number")
	case in.Amount <= 0:
		return errors.New("amount must be positive")
	}
	return nil
}

var fastPolicy = saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, Timeout: 10 * time.Second}

// ledgerStep writes one ledger row in the step's transaction.
func ledgerStep(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
	var in payoutInput
	if err := sc.DecodeInput(&in); err != nil {
		return nil, err
	}
	amount := in.Amount
	if sc.Phase == saga.PhaseCompensate {
		amount = -amount
	}
	if _, err := sc.Tx.Exec(ctx, `insert into httpapi_test.ledger (saga_id, step, phase, account, amount) values ($1, $2, $3, $4, $5)`,
		sc.SagaID, sc.Step, string(sc.Phase), in.Account, amount); err != nil {
		return nil, err
	}
	return json.RawMessage(`{"booked":` + string(must(json.Marshal(amount))) + `}`), nil
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// payout is a two-step saga of database steps with a typed, validated
// input.
var payout = saga.WithInput(saga.MustNew("payout",
	saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: ledgerStep, Compensate: ledgerStep, Retry: fastPolicy, CompensateRetry: fastPolicy},
	saga.Step{Name: "book", Reaches: "booked", Kind: saga.DatabaseStep, Forward: ledgerStep, Compensate: ledgerStep, Retry: fastPolicy, CompensateRetry: fastPolicy},
), payoutInput.validate)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// env is one test's database, engine client and API server on loopback.
type env struct {
	pool   *pgxpool.Pool
	client *engine.Client
	srv    *httptest.Server
	// token, when set, is sent as the bearer token of every request.
	token string
}

type envOpt func(*httpapi.Config)

func serve(t testing.TB, pool *pgxpool.Pool, client *engine.Client, opts ...envOpt) *env {
	t.Helper()
	cfg := httpapi.Config{Client: client, Logger: quietLogger()}
	for _, o := range opts {
		o(&cfg)
	}
	h, err := httpapi.New(cfg)
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/v1/", h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &env{pool: pool, client: client, srv: srv}
}

// newEnv serves the API with a client and no workers: sagas start and
// stay in init.
func newEnv(t testing.TB, opts ...envOpt) *env {
	t.Helper()
	pool := testenv.DB(t)
	cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{payout}, Logger: quietLogger()})
	require.NoError(t, err)
	return serve(t, pool, cl, opts...)
}

// newEngineEnv serves the API of a running engine: sagas run to their end.
func newEngineEnv(t *testing.T) *env {
	t.Helper()
	return engineEnvWith(t, payout)
}

// engineEnvWith serves the API of a running engine of defs.
func engineEnvWith(t *testing.T, defs ...*saga.Definition) *env {
	t.Helper()
	pool := testenv.DB(t)
	e, _ := runEngine(t, pool, "HTTPAPI", defs, nil)
	return serve(t, pool, e.Client())
}

// runEngine deploys and starts an engine of defs on pool, with an
// in-process JetStream and a stream named after prefix of its own, stopped
// when the test ends; edit, if set, changes its Config first. It returns
// the engine and the Config it runs with.
func runEngine(t *testing.T, pool *pgxpool.Pool, prefix string, defs []*saga.Definition, edit func(*engine.Config)) (*engine.Engine, engine.Config) {
	t.Helper()
	_, nc := testenv.NATS(t)
	stream := testenv.Name(prefix)
	cfg := engine.Config{Pool: pool, NATS: nc, Definitions: defs, Stream: stream, SubjectPrefix: "t." + stream,
		LeaseGrace: 10 * time.Second, ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond, Logger: quietLogger()}
	if edit != nil {
		edit(&cfg)
	}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(context.Background(), cfg))
	require.NoError(t, e.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(ctx))
	})
	return e, cfg
}

type response struct {
	status int
	header http.Header
	body   []byte
}

// problem decodes a problem body, checking its media type and status.
func (r response) problem(t testing.TB) httpapi.Problem {
	t.Helper()
	require.Equal(t, httpapi.ProblemContentType, r.header.Get("Content-Type"), "body: %s", r.body)
	var p httpapi.Problem
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&p))
	require.Equal(t, r.status, p.Status)
	require.NotEmpty(t, p.Type)
	require.NotEmpty(t, p.Title)
	require.NotEmpty(t, p.Detail)
	// The detail explains this occurrence; it does not say the title again.
	require.NotContains(t, strings.ToLower(p.Detail), strings.ToLower(p.Title), "the detail repeats the title: %s", r.body)
	return p
}

// hdr is a request header; one given twice is sent twice.
type hdr [2]string

func jsonType() hdr               { return hdr{"Content-Type", "application/json"} }
func key(k string) hdr            { return hdr{"Idempotency-Key", k} }
func startHeaders(k string) []hdr { return []hdr{jsonType(), key(k)} }

func (e *env) do(t testing.TB, method, path string, headers []hdr, body string) response {
	t.Helper()
	r, err := e.send(method, path, headers, body)
	require.NoError(t, err)
	return r
}

// send is do for goroutines other than the test's: it fails nothing.
func (e *env) send(method, path string, headers []hdr, body string) (response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.srv.URL+path, rd)
	if err != nil {
		return response{}, err
	}
	if e.token != "" {
		req.Header.Set("Authorization", "Bearer "+e.token)
	}
	for _, h := range headers {
		req.Header.Add(h[0], h[1])
	}
	res, err := e.srv.Client().Do(req)
	if err != nil {
		return response{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return response{status: res.StatusCode, header: res.Header, body: b}, err
}

// start posts a payout.
func (e *env) start(t testing.TB, k, body string) response {
	t.Helper()
	return e.do(t, http.MethodPost, "/v1/sagas/payout", startHeaders(k), body)
}

// started decodes a start's body.
func started(t testing.TB, r response) httpapi.Started {
	t.Helper()
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	var s httpapi.Started
	require.NoError(t, json.Unmarshal(r.body, &s))
	return s
}

func (e *env) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (e *env) sagaCount(t testing.TB) int {
	return e.count(t, `select count(*) from idemsaga.sagas`)
}

// nothingWritten checks that no saga and no command exist.
func (e *env) nothingWritten(t testing.TB) {
	t.Helper()
	require.Zero(t, e.sagaCount(t), "no saga may be written")
	require.Zero(t, e.count(t, `select count(*) from idemsaga.outbox`), "no command may be written")
}
