// Package httpcall makes the HTTP request of an external or callback
// step's attempt, right by default:
//
//   - It sends the step's key (StepContext.Key) as the Idempotency-Key
//     header, so the other system can answer a request sent again with
//     what it did the first time.
//   - It makes one request per attempt. Go's http.Transport resends a
//     request on its own when a reused connection drops before the answer
//     and it believes the request idempotent: any GET, and any request
//     that carries an Idempotency-Key header. The second request's answer
//     then hides the first's: a charge made, then a 503 for the resend
//     ("busy, nothing charged"). Do never lets the transport resend, and
//     follows no redirect.
//   - The attempt's context carries the step's timeout: Do ends with it.
//   - It classifies answers conservatively. A status the call names in
//     Success succeeds. One in Refused fails for good, without effect
//     (saga.Permanent). One in NotApplied says the other system answered
//     about the key, that nothing was done under it (saga.NotApplied). A
//     proxy's 502 or 503, a load balancer's 504 or a rate limiter's 429
//     is an answer about one request, never about the key: name a status
//     in NotApplied only when the other system documents it so for the
//     key. Everything else (other statuses, a transport error, the
//     timeout, an answer cut short) is unknown: the engine runs the next
//     attempt under the same key, and the other system answers it with
//     what the key did.
//   - A 429, or a 503 with Retry-After, that asks to come back later is
//     waited out inside the attempt (each wait at most Client.WaitMax, at
//     most five waits, and only while the attempt's time allows it), and
//     the request is sent again under the same key, so the wait spends no
//     attempt. These are the only requests after the first, and the last
//     answer is the one classified; Response.Requests counts them.
//
// A step's handler:
//
//	func charge(ctx context.Context, sc *saga.StepContext, in Order) (Charge, error) {
//		var c Charge
//		res, err := calls.Do(ctx, sc, httpcall.Call{
//			Method: http.MethodPost, URL: base + "/charges", JSON: ChargeRequest{...},
//			Success: []int{200, 201}, Refused: []int{402},
//		})
//		if err != nil {
//			return c, err
//		}
//		return c, res.Decode(&c)
//	}
package httpcall

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemsaga/idemsaga/saga"
)

// Defaults of Client.
const (
	// MaxBodyDefault bounds the answer's body Do reads.
	MaxBodyDefault = 1 << 20
	// WaitMaxDefault bounds one wait a Retry-After asks for.
	WaitMaxDefault = 10 * time.Second
)

// Call is the request of one step's attempt and how to read its answer.
type Call struct {
	Method string
	URL    string
	// Header is sent with the request; Do sets Idempotency-Key (and
	// Content-Type for JSON) over it.
	Header http.Header
	// Body is the request's body, or JSON, if not nil, is marshalled as
	// the body with Content-Type application/json. At most one.
	Body []byte
	JSON any
	// Success lists the statuses that mean the request took effect.
	// Defaults to 200 and 201.
	Success []int
	// Refused lists the statuses the other system answers when it
	// refuses the request for good, without effect (a card declined):
	// the step fails, saga.Permanent.
	Refused []int
	// NotApplied lists the statuses with which the other system says that
	// nothing was done under the key and that it may be tried again:
	// saga.NotApplied. Only the statuses its documentation gives about
	// the key; never a status a proxy or a rate limiter may answer too.
	NotApplied []int
}

// Response is the answer Do read.
type Response struct {
	Status int
	Header http.Header
	// Body is the answer's body, at most Client.MaxBody bytes.
	Body []byte
	// Requests is how many requests the call sent: 1, or more when the
	// other system asked to come back later (429, 503 with Retry-After).
	Requests int
}

// Decode decodes the body, JSON, into v.
func (r *Response) Decode(v any) error {
	if err := json.Unmarshal(r.Body, v); err != nil {
		return fmt.Errorf("httpcall: read the answer (status %d): %w", r.Status, err)
	}
	return nil
}

// StatusError is an answer whose status is not one of the call's
// Success statuses.
type StatusError struct {
	Method, URL string
	Status      int
	// Body is the start of the answer's body, for the step's error.
	Body string
}

func (e *StatusError) Error() string {
	s := fmt.Sprintf("%s %s answered %d %s", e.Method, e.URL, e.Status, http.StatusText(e.Status))
	if e.Body != "" {
		s += ": " + e.Body
	}
	return s
}

// Client sends the calls of steps. The zero Client is ready to use.
type Client struct {
	// Transport sends the requests. Defaults to http.DefaultTransport.
	// Do keeps it from resending a request on its own whatever it is.
	Transport http.RoundTripper
	// MaxBody bounds the answer's body read. Defaults to MaxBodyDefault.
	MaxBody int64
	// WaitMax bounds one wait that a Retry-After asks for. Defaults to
	// WaitMaxDefault; a negative value waits for none.
	WaitMax time.Duration
}

// waitsMax bounds the waits of one call, whatever time its attempt has.
const waitsMax = 5

// errorBody bounds the start of a body an error quotes.
const errorBody = 200

// Do sends c under sc.Key and classifies its answer: the response and nil
// for a Success status; saga.Permanent or saga.NotApplied of a
// *StatusError for a status in Refused or NotApplied; otherwise an error
// the engine takes as unknown (a *StatusError, or the transport's error).
// A call that cannot be built (no method or URL, Body and JSON both set,
// a JSON value that does not marshal) fails for good, sending nothing.
func (cl *Client) Do(ctx context.Context, sc *saga.StepContext, c Call) (*Response, error) {
	if sc == nil {
		return nil, saga.Permanent(errors.New("httpcall: Do needs the step's StepContext, whose key it sends"))
	}
	body, err := c.body()
	if err != nil {
		return nil, saga.Permanent(err)
	}
	hc := &http.Client{
		Transport: cl.Transport,
		// A redirect would be a second request.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	success := c.Success
	if len(success) == 0 {
		success = []int{http.StatusOK, http.StatusCreated}
	}
	res := &Response{}
	for {
		req, err := c.request(ctx, sc, body)
		if err != nil {
			return nil, saga.Permanent(err)
		}
		res.Requests++
		resp, err := hc.Do(req)
		if err != nil {
			return res, fmt.Errorf("httpcall: %s %s: %w", c.Method, c.URL, err)
		}
		res.Status, res.Header = resp.StatusCode, resp.Header
		res.Body, err = cl.read(resp)
		if err != nil {
			return res, fmt.Errorf("httpcall: %s %s: read the answer (status %d): %w", c.Method, c.URL, resp.StatusCode, err)
		}
		if d, ok := cl.comeBack(ctx, resp); ok && res.Requests <= waitsMax {
			t := time.NewTimer(d)
			select {
			case <-ctx.Done():
				t.Stop()
				return res, fmt.Errorf("httpcall: %s %s: waiting %s as its %d asked: %w", c.Method, c.URL, d, res.Status, ctx.Err())
			case <-t.C:
			}
			continue
		}
		break
	}
	serr := &StatusError{Method: c.Method, URL: c.URL, Status: res.Status, Body: quote(res.Body)}
	switch {
	case slices.Contains(success, res.Status):
		return res, nil
	case slices.Contains(c.Refused, res.Status):
		return res, saga.Permanent(serr)
	case slices.Contains(c.NotApplied, res.Status):
		return res, saga.NotApplied(serr)
	}
	return res, serr
}

func (c Call) body() ([]byte, error) {
	switch {
	case c.Method == "" || c.URL == "":
		return nil, errors.New("httpcall: a call needs a Method and a URL")
	case c.Body != nil && c.JSON != nil:
		return nil, errors.New("httpcall: give a call Body or JSON, not both")
	case c.JSON != nil:
		b, err := json.Marshal(c.JSON)
		if err != nil {
			return nil, fmt.Errorf("httpcall: marshal the body of %s %s: %w", c.Method, c.URL, err)
		}
		return b, nil
	}
	return c.Body, nil
}

// request builds one request of c. Its body is never nil and has no
// GetBody: http.Transport resends only a request it can replay (a nil
// body, or one with GetBody), so none of these is sent twice behind the
// engine's back. An empty body goes out as Content-Length 0, or none.
func (c Call) request(ctx context.Context, sc *saga.StepContext, body []byte) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, c.Method, c.URL, nil)
	if err != nil {
		return nil, fmt.Errorf("httpcall: %w", err)
	}
	for k, vs := range c.Header {
		req.Header[k] = slices.Clone(vs)
	}
	req.Body, req.ContentLength, req.GetBody = io.NopCloser(bytes.NewReader(body)), int64(len(body)), nil
	if c.JSON != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Idempotency-Key", sc.Key.String())
	return req, nil
}

func (cl *Client) read(resp *http.Response) ([]byte, error) {
	defer resp.Body.Close()
	limit := cl.MaxBody
	if limit <= 0 {
		limit = MaxBodyDefault
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("the body is over %d bytes (Client.MaxBody)", limit)
	}
	return b, nil
}

// comeBack returns how long to wait before sending the request again when
// the answer asks to come back later (429, or 503 with Retry-After) and
// the attempt's time allows the wait.
func (cl *Client) comeBack(ctx context.Context, resp *http.Response) (time.Duration, bool) {
	if resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return 0, false
	}
	d, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now())
	if !ok {
		return 0, false
	}
	limit := cl.WaitMax
	if limit == 0 {
		limit = WaitMaxDefault
	}
	if limit < 0 || d > limit {
		return 0, false
	}
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < d+d/2+100*time.Millisecond {
		// No time left for the wait and the answer after it: the
		// attempt ends now, unknown, and the next one asks again.
		return 0, false
	}
	return d, true
}

// retryAfter reads a Retry-After header: seconds, or an HTTP date.
func retryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if s, err := strconv.Atoi(v); err == nil {
		return time.Duration(max(s, 0)) * time.Second, true
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

func quote(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > errorBody {
		s = s[:errorBody] + "…"
	}
	return s
}
