package httpcall_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/saga/httpcall"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func stepContext() *saga.StepContext {
	id := uuid.New()
	return &saga.StepContext{SagaID: id, Step: "charge", Phase: saga.PhaseForward, Key: saga.StepKey(id, "charge", saga.PhaseForward), Attempt: 1}
}

// droppingServer speaks HTTP/1.1 on a loopback port and drops, without an
// answer, the second request of every connection, after reading it whole:
// a connection a proxy or the other system closed under a request that
// may have been taken. It answers the others 200, except a key seen
// before, which it answers 503 ("busy, nothing charged" for the resend).
type droppingServer struct {
	ln   net.Listener
	mu   sync.Mutex
	seen map[string]int
	wg   sync.WaitGroup
}

func newDroppingServer(t *testing.T) *droppingServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &droppingServer{ln: ln, seen: map[string]int{}}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Go(func() { s.serve(c) })
		}
	})
	t.Cleanup(func() { _ = ln.Close(); s.wg.Wait() })
	return s
}

func (s *droppingServer) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for n := 1; ; n++ {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		key := req.Header.Get("Idempotency-Key")
		s.mu.Lock()
		s.seen[key]++
		again := s.seen[key] > 1
		s.mu.Unlock()
		if n == 2 {
			return // taken, then the connection is gone
		}
		status := http.StatusOK
		if again {
			status = http.StatusServiceUnavailable
		}
		fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok", status, http.StatusText(status))
	}
}

func (s *droppingServer) requests(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[key]
}

func (s *droppingServer) url() string { return "http://" + s.ln.Addr().String() + "/charges" }

// TestOneRequestPerAttempt: Go's own transport sends a POST that carries
// an Idempotency-Key a second time when its reused connection drops after
// the request, and returns the second answer (503) as if it were the only
// one; Do sends it once and says the outcome is unknown.
func TestOneRequestPerAttempt(t *testing.T) {
	ctx := context.Background()
	t.Run("net/http resends behind the caller's back", func(t *testing.T) {
		s := newDroppingServer(t)
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		client := &http.Client{Transport: tr}
		post := func(key string) *http.Response {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url(), bytes.NewReader([]byte(`{"amount":5}`)))
			require.NoError(t, err)
			req.Header.Set("Idempotency-Key", key)
			resp, err := client.Do(req)
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			require.NoError(t, resp.Body.Close())
			return resp
		}
		post("warm-up")
		resp := post("k")
		require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "the caller sees only the second answer")
		require.Equal(t, 2, s.requests("k"), "one call, two requests")
	})
	t.Run("Do sends once", func(t *testing.T) {
		s := newDroppingServer(t)
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		cl := &httpcall.Client{Transport: tr}
		warm := stepContext()
		_, err := cl.Do(ctx, warm, httpcall.Call{Method: http.MethodPost, URL: s.url(), JSON: map[string]int{"amount": 5}})
		require.NoError(t, err)
		sc := stepContext()
		res, err := cl.Do(ctx, sc, httpcall.Call{Method: http.MethodPost, URL: s.url(), JSON: map[string]int{"amount": 5}, NotApplied: []int{503}})
		require.Error(t, err)
		require.False(t, saga.IsNotApplied(err), "no answer: unknown, never not applied")
		require.False(t, saga.IsPermanent(err))
		require.Equal(t, 1, res.Requests)
		require.Equal(t, 1, s.requests(sc.Key.String()), "one attempt, one request")
	})
}

// TestClassification: only the statuses a call names succeed, refuse or
// say not applied; every other answer is unknown, and no redirect is
// followed.
func TestClassification(t *testing.T) {
	var mu sync.Mutex
	var got []http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Clone())
		mu.Unlock()
		body, _ := io.ReadAll(r.Body)
		var status int
		_, _ = fmt.Sscanf(r.URL.Path, "/%d", &status)
		if status == http.StatusFound {
			http.Redirect(w, r, "/201", status)
			return
		}
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	defer srv.Close()
	ctx := context.Background()
	cl := &httpcall.Client{}
	call := func(status int) (*httpcall.Response, error) {
		return cl.Do(ctx, stepContext(), httpcall.Call{Method: http.MethodPost, URL: fmt.Sprintf("%s/%d", srv.URL, status),
			JSON: map[string]string{"to": "x"}, Success: []int{201}, Refused: []int{402}, NotApplied: []int{409}})
	}
	for _, c := range []struct {
		status                    int
		ok, permanent, notApplied bool
		decoded                   string
	}{
		{status: 201, ok: true, decoded: "x"},
		{status: 402, permanent: true},
		{status: 409, notApplied: true},
		{status: 200}, // not named: unknown
		{status: 302}, // a redirect is not followed
		{status: 429}, // no Retry-After: unknown
		{status: 500},
		{status: 502},
		{status: 503},
		{status: 504},
	} {
		t.Run(http.StatusText(c.status), func(t *testing.T) {
			res, err := call(c.status)
			require.Equal(t, c.status, res.Status)
			require.Equal(t, 1, res.Requests)
			if c.ok {
				require.NoError(t, err)
				var v map[string]string
				require.NoError(t, res.Decode(&v))
				require.Equal(t, c.decoded, v["to"])
				return
			}
			require.Error(t, err)
			require.Equal(t, c.permanent, saga.IsPermanent(err), "permanent")
			require.Equal(t, c.notApplied, saga.IsNotApplied(err), "not applied")
			var se *httpcall.StatusError
			require.ErrorAs(t, err, &se)
			require.Equal(t, c.status, se.Status)
		})
	}
	mu.Lock()
	defer mu.Unlock()
	for _, h := range got {
		_, err := uuid.Parse(h.Get("Idempotency-Key"))
		require.NoError(t, err, "every request carries the step key")
		require.Equal(t, "application/json", h.Get("Content-Type"))
	}
	require.Len(t, got, 10, "one request each, the redirect not followed")
}

// TestComeBackLater: a 429 or 503 with Retry-After is waited out inside
// the attempt and the request sent again under the same key; a wait longer
// than WaitMax, or than the attempt has left, ends the attempt unknown.
func TestComeBackLater(t *testing.T) {
	var mu sync.Mutex
	keys := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys[r.Header.Get("Idempotency-Key")]++
		n := keys[r.Header.Get("Idempotency-Key")]
		mu.Unlock()
		switch {
		case strings.HasSuffix(r.URL.Path, "/twice") && n <= 2:
			w.Header().Set("Retry-After", "0")
			w.WriteHeader([]int{http.StatusTooManyRequests, http.StatusServiceUnavailable}[n-1])
		case strings.HasSuffix(r.URL.Path, "/long"):
			w.Header().Set("Retry-After", "30")
			w.WriteHeader(http.StatusTooManyRequests)
		case strings.HasSuffix(r.URL.Path, "/later"):
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	}))
	defer srv.Close()
	cl := &httpcall.Client{}
	ctx := context.Background()

	sc := stepContext()
	res, err := cl.Do(ctx, sc, httpcall.Call{Method: http.MethodPost, URL: srv.URL + "/twice"})
	require.NoError(t, err)
	require.Equal(t, 3, res.Requests, "two waits, then the answer")
	mu.Lock()
	require.Equal(t, 3, keys[sc.Key.String()], "all under the step key")
	mu.Unlock()

	res, err = cl.Do(ctx, stepContext(), httpcall.Call{Method: http.MethodPost, URL: srv.URL + "/long"})
	require.Error(t, err)
	require.False(t, saga.IsNotApplied(err))
	require.Equal(t, 1, res.Requests, "30s is over WaitMax: no wait")

	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	res, err = cl.Do(short, stepContext(), httpcall.Call{Method: http.MethodPost, URL: srv.URL + "/later", NotApplied: []int{503}})
	require.True(t, saga.IsNotApplied(err), "no time for the wait: the answer is classified as it is")
	require.Equal(t, 1, res.Requests)
}

// TestBadCallSendsNothing: a call that cannot be built fails for good
// before any request.
func TestBadCallSendsNothing(t *testing.T) {
	cl := &httpcall.Client{}
	ctx := context.Background()
	for _, c := range []httpcall.Call{
		{URL: "http://127.0.0.1:1/x"},
		{Method: http.MethodPost},
		{Method: http.MethodPost, URL: "http://127.0.0.1:1/x", Body: []byte("a"), JSON: 1},
		{Method: http.MethodPost, URL: "http://127.0.0.1:1/x", JSON: func() {}},
	} {
		_, err := cl.Do(ctx, stepContext(), c)
		require.True(t, saga.IsPermanent(err), "%+v: %v", c, err)
	}
	_, err := cl.Do(ctx, nil, httpcall.Call{Method: http.MethodGet, URL: "http://127.0.0.1:1/x"})
	require.True(t, saga.IsPermanent(err))
	require.False(t, errors.Is(err, context.Canceled))
}

// TestAnswerBounded: an answer over MaxBody is not taken as read.
func TestAnswerBounded(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(bytes.Repeat([]byte("x"), 100))
	}))
	defer srv.Close()
	cl := &httpcall.Client{MaxBody: 10}
	_, err := cl.Do(context.Background(), stepContext(), httpcall.Call{Method: http.MethodPost, URL: srv.URL, Success: []int{201}})
	require.ErrorContains(t, err, "over 10 bytes")
	require.False(t, saga.IsPermanent(err) || saga.IsNotApplied(err), "unknown")
}
