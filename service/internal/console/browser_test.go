package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/console"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// chromiumDefault is where Debian's chromium package puts the browser.
const chromiumDefault = "/usr/bin/chromium"

// chromiumPath is the browser the test drives: IDEMSAGA_CHROMIUM, or
// Debian's. A missing browser fails the test, saying how to install it.
func chromiumPath(t *testing.T) string {
	t.Helper()
	path := os.Getenv("IDEMSAGA_CHROMIUM")
	if path == "" {
		path = chromiumDefault
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the console's browser test needs Chromium at %s (%v): run scripts/ensure-chromium.sh, which installs Debian's package "+
			"(as root: apt-get install -y --no-install-recommends chromium), or point IDEMSAGA_CHROMIUM at a Chromium or Chrome binary", path, err)
	}
	return path
}

// screenshotDir is where the test saves its PNGs: IDEMSAGA_SCREENSHOTS
// when set, else a directory removed after the test.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("IDEMSAGA_SCREENSHOTS")
	if dir == "" {
		return t.TempDir()
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	return dir
}

const apiToken = "console-e2e-token-7f3a9c1d2b"

// viewerToken is a token of scope read (named viewer) the console's
// server also takes.
const viewerToken = "console-viewer-token-5e1b8d2c"

// consoleSaga is a payout of two database steps: book refuses amounts
// over 1000 for good, and reserve's compensation fails while refundDown
// is set, so such a saga ends failed until someone fixes the refunds and
// retries it.
func consoleSaga(refundDown *atomic.Bool) *saga.Definition {
	quick := saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 10 * time.Millisecond, Timeout: 10 * time.Second}
	write := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		var in struct {
			Amount int64 `json:"amount"`
		}
		if err := sc.DecodeInput(&in); err != nil {
			return nil, err
		}
		if sc.Step == "book" && in.Amount > 1000 {
			return nil, saga.Permanent(fmt.Errorf("amount %d is over the account's limit of 1000", in.Amount))
		}
		if sc.Step == "reserve" && sc.Phase == saga.PhaseCompensate && refundDown.Load() {
			return nil, errors.New("the refund ledger is locked for maintenance")
		}
		amount := in.Amount
		if sc.Phase == saga.PhaseCompensate {
			amount = -amount
		}
		if _, err := sc.Tx.Exec(ctx, `insert into console_test.ledger (saga_id, step, phase, amount) values ($1, $2, $3, $4)`,
			sc.SagaID, sc.Step, string(sc.Phase), amount); err != nil {
			return nil, err
		}
		return json.RawMessage(fmt.Sprintf(`{"booked":%d}`, amount)), nil
	}
	return saga.MustNew("payout",
		saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep, Forward: write, Compensate: write, Retry: quick, CompensateRetry: quick},
		saga.Step{Name: "book", Reaches: "booked", Kind: saga.DatabaseStep, Forward: write, Compensate: write, Retry: quick, CompensateRetry: quick},
	)
}

// consoleEnv is a running engine with the API and the console on one
// loopback server, as `worker run` mounts them.
type consoleEnv struct {
	srv    *httptest.Server
	client *engine.Client
	pool   *pgxpool.Pool
	// token is the API token required, "" for none.
	token string
}

// newConsoleEnv serves def's engine; token, unless "", is the one API
// token the server takes.
func newConsoleEnv(t *testing.T, def *saga.Definition, token string) *consoleEnv {
	t.Helper()
	return newConsoleEnvOf(t, token, nil, def)
}

// newConsoleEnvOf serves the engine of defs, as newConsoleEnv does;
// before, if not nil, runs on the NATS connection before the engine
// starts (to create a publisher's stream).
func newConsoleEnvOf(t *testing.T, token string, before func(nc *nats.Conn), defs ...*saga.Definition) *consoleEnv {
	t.Helper()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	if before != nil {
		before(nc)
	}
	stream := testenv.Name("CONSOLE")
	reg := prometheus.NewRegistry()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	cfg := engine.Config{Pool: pool, NATS: nc, Definitions: defs, Stream: stream, SubjectPrefix: "t." + stream,
		ReapInterval: 20 * time.Millisecond, RelayPollInterval: 20 * time.Millisecond, Logger: quiet, Registerer: reg}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(context.Background(), cfg))
	require.NoError(t, e.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(ctx))
	})
	var tokens *httpapi.Tokens
	if token != "" {
		tokens, err = httpapi.ParseTokens("console operator * " + token + "\nviewer read * " + viewerToken)
		require.NoError(t, err)
	}
	api, err := httpapi.New(httpapi.Config{Client: e.Client(), Tokens: tokens, Logger: quiet, Gatherer: reg})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/v1/", api)
	mux.Handle(console.Prefix, console.Handler())
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &consoleEnv{srv: srv, client: e.Client(), pool: pool, token: token}
}

// send makes one API request, with the token when withToken.
func (c *consoleEnv) send(t *testing.T, method, path, key, body string, withToken bool) (int, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, c.srv.URL+path, rd)
	require.NoError(t, err)
	if withToken && c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := c.srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// start starts a payout over HTTP and answers its ID.
func (c *consoleEnv) start(t *testing.T, key string, amount int) string {
	t.Helper()
	status, body := c.send(t, http.MethodPost, "/v1/sagas/payout", key, fmt.Sprintf(`{"amount":%d}`, amount), true)
	require.Contains(t, []int{http.StatusCreated, http.StatusOK}, status, "body: %s", body)
	var s httpapi.Started
	require.NoError(t, json.Unmarshal([]byte(body), &s))
	return s.ID.String()
}

// waitState waits until saga id is in state.
func (c *consoleEnv) waitState(t *testing.T, id string, state saga.State) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		status, body := c.send(t, http.MethodGet, "/v1/sagas/"+id, "", "", true)
		require.Equal(t, http.StatusOK, status, "body: %s", body)
		var sg httpapi.Saga
		require.NoError(t, json.Unmarshal([]byte(body), &sg))
		if sg.State == state {
			return
		}
		require.True(t, time.Now().Before(deadline), "saga %s is %s after 15s, want %s", id, sg.State, state)
		time.Sleep(20 * time.Millisecond)
	}
}

// browser starts a headless Chromium of its own, closed when the test
// ends, and collects what the page writes to its console.
type browser struct {
	ctx  context.Context
	mu   sync.Mutex
	errs []string
}

func newBrowser(t *testing.T) *browser {
	t.Helper()
	path := chromiumPath(t)
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox, // the tests may run as root
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		// On a machine without internet, Chromium's own fetches stall it.
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		// Chromium makes scratch folders (org.chromium.Chromium.*) in
		// TMPDIR and leaves them behind; these land in the test's own.
		chromedp.Env("TMPDIR="+t.TempDir()),
		chromedp.WindowSize(1360, 1000),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx)
	// Cancelling the allocator waits for the browser to exit, before its
	// user data directory is removed.
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	b := &browser{ctx: ctx}
	require.NoError(t, chromedp.Listen(ctx, func(ev any) {
		b.mu.Lock()
		defer b.mu.Unlock()
		switch ev := ev.(type) {
		case *runtime.EventExceptionThrown:
			b.errs = append(b.errs, "exception: "+ev.ExceptionDetails.Text+" "+exceptionText(ev.ExceptionDetails))
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError {
				b.errs = append(b.errs, "console.error")
			}
		case *cdplog.EventEntryAdded:
			// A refused request (the 401 before signing in, a refused
			// repair) is the network's entry, and expected.
			if ev.Entry.Level == cdplog.EntryLevelError && ev.Entry.Source != cdplog.EntrySourceNetwork {
				b.errs = append(b.errs, string(ev.Entry.Source)+": "+ev.Entry.Text)
			}
		}
	}), "start chromium at %s", path)
	return b
}

// colorScheme makes the page see prefers-color-scheme as scheme.
func colorScheme(scheme string) chromedp.Action[chromedp.Void] {
	return func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
		_, err := cdp.Call(ctx, t, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{
			Features: []*emulation.MediaFeature{{Name: "prefers-color-scheme", Value: scheme}}})
		return chromedp.Void{}, err
	}
}

// timeZone makes the page's local time zone tz (an IANA name).
func timeZone(tz string) chromedp.Action[chromedp.Void] {
	return func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
		_, err := cdp.Call(ctx, t, emulation.SetTimezoneOverride, emulation.SetTimezoneOverrideParams{TimezoneID: tz})
		return chromedp.Void{}, err
	}
}

// do runs actions within a deadline, failing the test with what failed.
func (b *browser) do(t *testing.T, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, browserWait)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		b.failed(t, fmt.Sprintf("%s: %v", what, err))
	}
}

// browserWait bounds one step of a browser test: a cold Chromium beside a
// loaded -race suite can take seconds to lay a page out.
const browserWait = 30 * time.Second

// text reads the text of the element sel.
func (b *browser) text(t *testing.T, sel string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	require.NoError(t, err, "read %s", sel)
	return s
}

// waitJS waits until the JavaScript expression is true.
func (b *browser) waitJS(t *testing.T, what, expr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, browserWait)
	defer cancel()
	_, err := chromedp.Run(ctx, chromedp.Poll[bool](expr, chromedp.WithPollingInterval(50*time.Millisecond)))
	if err != nil {
		b.failed(t, fmt.Sprintf("waiting for %s (%s): %v", what, expr, err))
	}
}

// failed fails the test with what the page shows, saving it as
// failure.png beside the screenshots.
func (b *browser) failed(t *testing.T, msg string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	text, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	if png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)); err == nil {
		path := filepath.Join(screenshotDir(t), "failure.png")
		if os.WriteFile(path, png, 0o644) == nil {
			msg += "\nthe page is saved as " + path
		}
	}
	b.mu.Lock()
	errs := strings.Join(b.errs, "\n")
	b.mu.Unlock()
	t.Fatalf("%s\npage errors: %s\nthe page reads:\n%s", msg, errs, text)
}

// screenshot saves the page as dir/name.png.
func (b *browser) screenshot(t *testing.T, dir, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err, "screenshot %s", name)
	path := filepath.Join(dir, name+".png")
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("screenshot %s", path)
}

func (b *browser) noPageErrors(t *testing.T) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	require.Empty(t, b.errs, "the page reported errors")
}

// TestConsoleInBrowser drives the console in headless Chromium against a
// real engine: without the token it shows nothing but the sign-in form
// and the API answers no data; signed in, the list counts the sagas by
// state and shows the failed one; its page shows the failed compensation
// in the timeline; its Retry button, once the fault is cleared, brings it
// to compensated in the page; the live figures count what finished.
func TestConsoleInBrowser(t *testing.T) {
	t.Parallel()
	var refundDown atomic.Bool
	refundDown.Store(true)
	env := newConsoleEnv(t, consoleSaga(&refundDown), apiToken)
	shots := screenshotDir(t)

	var done []string
	for i := range 5 {
		done = append(done, env.start(t, fmt.Sprintf("order-%d", 1001+i), 100*(i+1)))
	}
	env.start(t, "order-1001", 100) // a client's retry: absorbed as a duplicate
	failed := env.start(t, "order-2001", 5000)
	for _, id := range done {
		env.waitState(t, id, "booked")
	}
	env.waitState(t, failed, saga.StateFailed)

	// No data without the token, wherever one asks.
	for _, path := range []string{"/v1/sagas", "/v1/sagas/" + failed, "/v1/stats", "/v1/definitions"} {
		status, body := env.send(t, http.MethodGet, path, "", "", false)
		require.Equal(t, http.StatusUnauthorized, status, "%s: %s", path, body)
		require.NotContains(t, body, failed, path)
		require.NotContains(t, body, "order-", path)
	}
	status, _ := env.send(t, http.MethodPost, "/v1/sagas/"+failed+"/retry", "no-token-retry", "", false)
	require.Equal(t, http.StatusUnauthorized, status)

	b := newBrowser(t)
	// A zone away from UTC, so that the time setting shows a difference.
	b.do(t, "the browser in India", timeZone("Asia/Kolkata"))
	b.do(t, "open the console", chromedp.Navigate(env.srv.URL+"/ui/"), chromedp.WaitVisible(chromedp.CSS("#token")))
	page := b.text(t, "body")
	require.NotContains(t, page, "order-", "before signing in the page shows no saga")
	b.screenshot(t, shots, "0-sign-in")

	// A wrong token is refused with the API's words.
	b.do(t, "sign in with a wrong token", chromedp.SendKeys(chromedp.CSS("#token"), "not-the-right-token-at-all"),
		chromedp.Click(chromedp.CSS("#login-btn")), chromedp.WaitVisible(chromedp.CSS("#login-error")))
	require.Contains(t, b.text(t, "#login-error"), "not one of the server's API tokens")

	b.do(t, "sign in", chromedp.SetValue(chromedp.CSS("#token"), apiToken),
		chromedp.Click(chromedp.CSS("#login-btn")))
	b.waitJS(t, "the counts by state", `document.querySelector('#counts .chip[data-state="booked"][data-count="5"]') !== null &&
		document.querySelector('#counts .chip[data-state="failed"][data-count="1"]') !== null &&
		document.querySelector('#counts .chip[data-state="all"][data-count="6"]') !== null`)
	b.waitJS(t, "the failed saga in the list", fmt.Sprintf(`document.querySelector('#saga-rows tr[data-id=%q][data-state="failed"]') !== null`, failed))
	require.Equal(t, 6, b.count(t, "#saga-rows tr[data-id]"))
	require.Contains(t, b.text(t, "#attention"), "1 saga needs a person")
	b.waitJS(t, "the token kept for this tab", fmt.Sprintf(`sessionStorage.getItem('idemsaga.console.token') === %q`, apiToken))
	b.waitJS(t, "the token's name and scope in the header", `document.querySelector('#session-state').textContent === 'signed in as console (operator)'`)
	b.screenshot(t, shots, "1-sagas-list")

	// A reload keeps the tab signed in.
	b.do(t, "reload", chromedp.Reload())
	b.waitJS(t, "the list again, without signing in", `document.querySelector('#counts .chip[data-state="failed"][data-count="1"]') !== null && document.querySelector('#token') === null`)

	// The state filter narrows the list to the failed saga.
	b.do(t, "filter failed", chromedp.Click(chromedp.CSS(`#counts .chip[data-state="failed"]`)))
	b.waitJS(t, "only the failed saga", `location.hash === '#/sagas?state=failed' && document.querySelectorAll('#saga-rows tr[data-id]').length === 1`)

	b.do(t, "open the failed saga", chromedp.Click(chromedp.CSS(fmt.Sprintf(`#saga-rows tr[data-id=%q] a`, failed))))
	b.waitJS(t, "the failed saga's page", `document.querySelector('#saga-state[data-state="failed"]') !== null`)
	b.waitJS(t, "the failed compensations in the timeline",
		`document.querySelectorAll('#timeline li[data-phase="compensate"][data-step="reserve"][data-outcome="retry"], #timeline li[data-phase="compensate"][data-step="reserve"][data-outcome="failed"]').length === 2`)
	require.Contains(t, b.text(t, "#saga-error-text"), "refund ledger is locked")
	require.Contains(t, b.text(t, "#timeline"), "amount 5000 is over the account's limit of 1000")
	require.Contains(t, b.text(t, "#steps"), saga.StepKey(uuid.MustParse(failed), "reserve", saga.PhaseCompensate).String(), "the steps show their keys")
	b.screenshot(t, shots, "2-saga-failed-before-retry")

	// A refused repair shows the API's text: a failed saga is finished,
	// so there is nothing to pause.
	b.do(t, "ask to pause", chromedp.Click(chromedp.CSS("#repair-pause")), chromedp.WaitVisible(chromedp.CSS("#repair-send")),
		chromedp.Click(chromedp.CSS("#repair-send")), chromedp.WaitVisible(chromedp.CSS("#repair-error")))
	require.Contains(t, b.text(t, "#repair-error"), "409")

	refundDown.Store(false)
	b.do(t, "retry by its button", chromedp.Click(chromedp.CSS("#repair-retry")), chromedp.WaitVisible(chromedp.CSS("#repair-send")),
		chromedp.SendKeys(chromedp.CSS("#repair-reason"), "refund ledger back"),
		chromedp.Click(chromedp.CSS("#repair-send")), chromedp.WaitVisible(chromedp.CSS("#repair-ok")))
	b.waitJS(t, "the saga compensated in the page", `document.querySelector('#saga-state[data-state="compensated"]') !== null &&
		document.querySelector('#timeline li[data-phase="compensate"][data-step="reserve"][data-outcome="succeeded"]') !== null`)
	require.Equal(t, "compensated", b.text(t, "#saga-state"))
	require.Contains(t, b.text(t, "#repairs"), "refund ledger back")
	require.Contains(t, b.text(t, "#repairs"), "console-retry-", "the repair carried the console's Idempotency-Key")
	b.screenshot(t, shots, "3-saga-compensated-after-retry")
	env.waitState(t, failed, saga.StateCompensated)

	// Find: a key lists the saga started under it, an ID opens its saga,
	// and a key where an ID goes says so, with no repair to send and no
	// polling.
	b.do(t, "open the list", chromedp.Click(chromedp.CSS(`#nav a[data-view="sagas"]`)), chromedp.WaitVisible(chromedp.CSS("#find")))
	b.do(t, "find by key", chromedp.SetValue(chromedp.CSS("#find"), "order-1003"), chromedp.Click(chromedp.CSS("#find-btn")))
	b.waitJS(t, "the saga of the key", `location.hash === '#/sagas?key=order-1003' && document.querySelectorAll('#saga-rows tr[data-id]').length === 1 &&
		document.querySelector('#saga-rows tr[data-id]').textContent.includes('order-1003')`)
	// A row is opened from the keyboard: focused, then Enter.
	b.do(t, "open the row by the keyboard", chromedp.Focus(chromedp.CSS(`#saga-rows tr[data-id]`)), chromedp.KeyEvent(kb.Enter))
	b.waitJS(t, "the row's saga", `location.hash.startsWith('#/saga/') && (document.querySelector('#saga-head') || {textContent: ''}).textContent.includes('order-1003')`)
	b.do(t, "back to the list", chromedp.Click(chromedp.CSS(`#nav a[data-view="sagas"]`)), chromedp.WaitVisible(chromedp.CSS("#find")))
	b.do(t, "find by ID", chromedp.SetValue(chromedp.CSS("#find"), strings.ToUpper(failed)), chromedp.Click(chromedp.CSS("#find-btn")))
	b.waitJS(t, "the saga of the ID", fmt.Sprintf(`(document.querySelector('#saga-id') || {}).textContent === %q`, failed))
	b.do(t, "a key where an ID goes", chromedp.Navigate(env.srv.URL+"/ui/#/saga/order-1003"))
	b.waitJS(t, "no saga, and a way to the key", `(document.querySelector('#saga-head') || {textContent: ''}).textContent.includes('No saga to show') &&
		document.querySelector('#repair').hidden && document.querySelector('#saga-head a[href="#/sagas?key=order-1003"]') !== null`)

	// The list's order and filters reach the API.
	b.do(t, "oldest first", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?order=oldest"))
	b.waitJS(t, "the oldest saga first", `(document.querySelector('#saga-rows tr[data-id]') || {textContent: ''}).textContent.includes('order-1001') &&
		document.querySelector('#filter-order').value === 'oldest'`)
	b.do(t, "only paused", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?only=paused"))
	b.waitJS(t, "no paused saga", `document.querySelector('#filter-only').value === 'paused' && document.querySelector('#saga-rows').textContent.includes('No saga matches these filters')`)

	// Live figures: more sagas while the page polls, with duplicates.
	b.do(t, "open the live figures", chromedp.Click(chromedp.CSS(`#nav a[data-view="live"]`)), chromedp.WaitVisible(chromedp.CSS("#live-finished")))
	// Three batches, each once the page counted the one before, so that
	// the plot has points to draw.
	finished := 7
	for batch := range 3 {
		for i := range 10 {
			n := 10*batch + i
			key := fmt.Sprintf("order-%d", 3001+n)
			env.start(t, key, 10+n)
			if n%3 == 0 {
				env.start(t, key, 10+n)
			}
		}
		finished += 10
		b.waitJS(t, fmt.Sprintf("%d sagas counted finished", finished), fmt.Sprintf(
			`(document.querySelector('#live-finished .sub') || {}).textContent === '%d finishes decided here'`, finished))
	}
	b.waitJS(t, "37 sagas finished and a rate", `(() => {
  const v = document.querySelector('#live-finished .value'), s = document.querySelector('#live-finished .sub');
  return v && s && parseFloat(v.textContent) > 0 && s.textContent === '37 finishes decided here';
})()`)
	b.waitJS(t, "the start layer's duplicates", `(() => {
  const r = document.querySelector('#live-layers tr[data-layer="start"]');
  return r && r.children[2].textContent === '11' && r.children[1].textContent === '47';
})()`)
	// recent's duplicates are a share of the step commands the inbox
	// layer counts: the two rows show one Seen, and the page says whose
	// counters these are.
	b.waitJS(t, "recent and inbox over the same commands", `(() => {
  const r = document.querySelector('#live-layers tr[data-layer="recent"]'), i = document.querySelector('#live-layers tr[data-layer="inbox"]');
  return r && i && parseInt(i.children[1].textContent) > 0 && r.children[1].firstChild.textContent === i.children[1].firstChild.textContent;
})()`)
	require.Contains(t, b.text(t, "#live-scope"), "counters of the one process that answers this page, since it last started")
	require.Contains(t, b.text(t, "#live-scope"), "The Sagas list counts the database")
	require.NotEqual(t, "unknown", b.text(t, "#live-stream .value"), "the stream's backlog is read")
	require.Equal(t, "0", b.text(t, "#live-takeovers .value"))
	b.waitJS(t, "the plot of sagas finished per second", `document.querySelector('#live-spark path.spark-line') !== null`)
	b.screenshot(t, shots, "4-live-figures")

	// The time setting: UTC until chosen; the header switches every time
	// on the page to the browser's zone, and the choice is remembered.
	var failedSaga httpapi.Saga
	status, body := env.send(t, http.MethodGet, "/v1/sagas/"+failed, "", "", true)
	require.Equal(t, http.StatusOK, status, body)
	require.NoError(t, json.Unmarshal([]byte(body), &failedSaga))
	inUTC := failedSaga.CreatedAt.UTC().Format("2006-01-02 15:04:05.000") + " UTC"
	inIndia := failedSaga.CreatedAt.In(time.FixedZone("IST", 5*3600+30*60)).Format("2006-01-02 15:04:05.000 -07:00")
	b.do(t, "open the saga again", chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+failed))
	b.waitJS(t, "its creation in UTC", fmt.Sprintf(`(document.querySelector('#saga-created') || {}).textContent === %q`, inUTC))
	require.Equal(t, "Times: UTC", b.text(t, "#time-zone"))
	b.do(t, "switch to local time", chromedp.Click(chromedp.CSS("#time-zone")))
	b.waitJS(t, "its creation in India's time", fmt.Sprintf(`(document.querySelector('#saga-created') || {}).textContent === %q`, inIndia))
	require.Equal(t, "Times: local (UTC+05:30)", b.text(t, "#time-zone"))
	require.Contains(t, b.text(t, "#repairs"), "+05:30", "the repairs' times follow the setting")
	require.NotContains(t, b.text(t, "#saga-body"), " UTC", "no time left in UTC on the page")
	b.do(t, "reload", chromedp.Reload())
	b.waitJS(t, "local time remembered", fmt.Sprintf(`(document.querySelector('#saga-created') || {}).textContent === %q && localStorage.getItem('idemsaga.console.zone') === 'local'`, inIndia))
	b.screenshot(t, shots, "4b-saga-in-local-time")
	b.do(t, "back to UTC", chromedp.Click(chromedp.CSS("#time-zone")))
	b.waitJS(t, "its creation in UTC again", fmt.Sprintf(`(document.querySelector('#saga-created') || {}).textContent === %q && localStorage.getItem('idemsaga.console.zone') === 'utc'`, inUTC))

	// Pause a definition from the list: its sagas are held.
	b.do(t, "the list of payouts", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?definition=payout"))
	b.waitJS(t, "the definition running", `document.querySelector('#definition-bar[data-paused="false"] #definition-op[data-op="pause"]') !== null`)
	b.do(t, "pause the definition", chromedp.Click(chromedp.CSS("#definition-op")), chromedp.WaitVisible(chromedp.CSS("#definition-send")),
		chromedp.SendKeys(chromedp.CSS("#definition-reason-input"), "ledger migration"),
		chromedp.Click(chromedp.CSS("#definition-send")), chromedp.WaitVisible(chromedp.CSS("#definition-ok")))
	b.waitJS(t, "the definition paused in the page", `document.querySelector('#definition-bar[data-paused="true"] #definition-op[data-op="resume"]') !== null`)
	b.waitJS(t, "the pause's reason", `(document.querySelector('#definition-reason') || {}).textContent === 'ledger migration'`)
	var defs httpapi.Definitions
	status, body = env.send(t, http.MethodGet, "/v1/definitions", "", "", true)
	require.Equal(t, http.StatusOK, status, body)
	require.NoError(t, json.Unmarshal([]byte(body), &defs))
	require.Len(t, defs.Definitions, 1)
	require.NotNil(t, defs.Definitions[0].Paused, "the definition is paused")
	require.Equal(t, "ledger migration", defs.Definitions[0].Paused.Reason)
	held := []string{env.start(t, "order-4001", 7000), env.start(t, "order-4002", 8000)}

	// A filter the bulk API cannot express is said, and nothing offered.
	b.do(t, "payouts created from a time", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?definition=payout&state=init&from=2000-01-01T00%3A00%3A00.000Z"))
	b.waitJS(t, "the list", `document.querySelector('#bulk-open') !== null`)
	b.do(t, "open the bulk repair", chromedp.Click(chromedp.CSS("#bulk-open")), chromedp.WaitVisible(chromedp.CSS("#bulk-blocked")))
	require.Contains(t, b.text(t, "#bulk-blocked"), "created from 2000-01-01 00:00:00.000 UTC")
	require.Contains(t, b.text(t, "#bulk-blocked"), "selects sagas by definition and state only")
	require.Equal(t, 0, b.count(t, "#bulk-dry"), "no repair to send")

	// Bulk cancel of the held sagas: a dry run writes nothing and says
	// what would change; Apply, pressed twice, repairs each once.
	b.do(t, "the held payouts", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?definition=payout&state=init"))
	b.waitJS(t, "the two held sagas listed", `document.querySelectorAll('#saga-rows tr[data-id]').length === 2`)
	b.do(t, "open the bulk repair", chromedp.Click(chromedp.CSS("#bulk-open")), chromedp.WaitVisible(chromedp.CSS("#bulk-op")))
	b.do(t, "dry run a cancel", chromedp.SetValue(chromedp.CSS("#bulk-op"), "cancel"),
		chromedp.SendKeys(chromedp.CSS("#bulk-reason"), "orders withdrawn"),
		chromedp.Click(chromedp.CSS("#bulk-dry")))
	b.waitJS(t, "what would change", `document.querySelector('#bulk-dry-result[data-count="2"][data-changes="2"]') !== null &&
		document.querySelectorAll('#bulk-items tr[data-outcome="repaired"]').length === 2 && !document.querySelector('#bulk-apply').hidden`)
	for _, id := range held {
		require.Contains(t, b.text(t, "#bulk-items"), id)
	}
	require.Equal(t, "Apply cancel to 2 sagas", b.text(t, "#bulk-apply"))
	b.screenshot(t, shots, "4c-bulk-dry-run")
	for _, id := range held {
		var sg httpapi.Saga
		status, body := env.send(t, http.MethodGet, "/v1/sagas/"+id, "", "", true)
		require.Equal(t, http.StatusOK, status, body)
		require.NoError(t, json.Unmarshal([]byte(body), &sg))
		require.Empty(t, sg.Repairs, "the dry run wrote no repair")
		require.Equal(t, saga.State("init"), sg.State)
	}
	b.do(t, "apply, twice", chromedp.DoubleClick(chromedp.CSS("#bulk-apply")))
	b.waitJS(t, "the cancel applied", `document.querySelector('#bulk-ok[data-count="2"][data-changes="2"]') !== null`)
	require.Contains(t, b.text(t, "#bulk-ok"), "2 sagas repaired, 0 refused")
	require.NotContains(t, b.text(t, "#bulk-ok"), "replayed", "one request for the two clicks")
	b.screenshot(t, shots, "4d-bulk-applied")
	for _, id := range held {
		var sg httpapi.Saga
		status, body := env.send(t, http.MethodGet, "/v1/sagas/"+id, "", "", true)
		require.Equal(t, http.StatusOK, status, body)
		require.NoError(t, json.Unmarshal([]byte(body), &sg))
		require.Len(t, sg.Repairs, 1, "one cancel of each")
		r := sg.Repairs[0]
		require.Equal(t, "cancel", r.Operation)
		require.NotNil(t, r.Reason)
		require.Equal(t, "orders withdrawn", *r.Reason)
		require.True(t, strings.HasPrefix(r.Key, "console-bulk-cancel-") && strings.HasSuffix(r.Key, "/"+id), r.Key)
	}

	// Resume the definition from the list: the cancelled sagas finish
	// their compensation.
	b.do(t, "the payouts", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?definition=payout"))
	b.waitJS(t, "the definition paused", `document.querySelector('#definition-bar[data-paused="true"] #definition-op[data-op="resume"]') !== null`)
	b.do(t, "resume the definition", chromedp.Click(chromedp.CSS("#definition-op")), chromedp.WaitVisible(chromedp.CSS("#definition-send")),
		chromedp.Click(chromedp.CSS("#definition-send")), chromedp.WaitVisible(chromedp.CSS("#definition-ok")))
	b.waitJS(t, "the definition running in the page", `document.querySelector('#definition-bar[data-paused="false"]') !== null`)
	for _, id := range held {
		env.waitState(t, id, saga.StateCompensated)
	}
	status, body = env.send(t, http.MethodGet, "/v1/definitions", "", "", true)
	require.Equal(t, http.StatusOK, status, body)
	defs = httpapi.Definitions{}
	require.NoError(t, json.Unmarshal([]byte(body), &defs))
	require.Nil(t, defs.Definitions[0].Paused, "the definition runs again")

	// At phone width, in the dark: nothing overflows the page (a wide
	// table scrolls in its card), and the surfaces are dark.
	b.do(t, "a phone, in the dark", chromedp.EmulateViewport(360, 800),
		colorScheme("dark"),
		chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+failed))
	b.waitJS(t, "the saga at 360 px", fmt.Sprintf(`(document.querySelector('#saga-id') || {}).textContent === %q`, failed))
	b.waitJS(t, "no page-wide overflow at 360 px", `document.documentElement.scrollWidth <= 360`)
	b.waitJS(t, "dark surfaces", `getComputedStyle(document.body).backgroundColor === 'rgb(15, 20, 28)'`)
	b.screenshot(t, shots, "3b-saga-at-360px-dark")
	b.do(t, "the list at 360 px", chromedp.Navigate(env.srv.URL+"/ui/#/sagas"))
	b.waitJS(t, "the list", `document.querySelectorAll('#saga-rows tr[data-id]').length > 0 && document.documentElement.scrollWidth <= 360`)
	b.screenshot(t, shots, "3c-list-at-360px-dark")
	b.do(t, "a bulk dry run at 360 px", chromedp.Navigate(env.srv.URL+"/ui/#/sagas?definition=payout&state=compensated"))
	b.waitJS(t, "the compensated payouts", `document.querySelectorAll('#saga-rows tr[data-id]').length === 3 && document.querySelector('#definition-bar') !== null`)
	b.do(t, "dry run a close", chromedp.Click(chromedp.CSS("#bulk-open")), chromedp.WaitVisible(chromedp.CSS("#bulk-op")),
		chromedp.SetValue(chromedp.CSS("#bulk-op"), "close"), chromedp.Click(chromedp.CSS("#bulk-dry")))
	b.waitJS(t, "the refusals, at 360 px", `document.querySelector('#bulk-dry-result[data-count="3"][data-changes="0"]') !== null &&
		document.querySelector('#bulk-apply').hidden && document.documentElement.scrollWidth <= 360`)
	require.Contains(t, b.text(t, "#bulk-items"), "409", "each saga's refusal in the API's words")
	b.screenshot(t, shots, "3d-bulk-at-360px-dark")
	b.do(t, "live figures at 360 px", chromedp.Navigate(env.srv.URL+"/ui/#/live"))
	b.waitJS(t, "the figures", `document.querySelector('#live-layers tr[data-layer="recent"]') !== null && document.documentElement.scrollWidth <= 360`)
	b.screenshot(t, shots, "3e-live-at-360px-dark")
	b.do(t, "back to a desktop, in the light", chromedp.EmulateViewport(1360, 1000),
		colorScheme("light"))

	// Signing out forgets the token and shows no data.
	b.do(t, "sign out", chromedp.Click(chromedp.CSS("#sign-out")), chromedp.WaitVisible(chromedp.CSS("#token")))
	b.waitJS(t, "the token forgotten", `sessionStorage.getItem('idemsaga.console.token') === null && !document.body.textContent.includes('order-')`)
	b.noPageErrors(t)
}

func (b *browser) count(t *testing.T, sel string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	n, err := chromedp.Run(ctx, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, sel)))
	require.NoError(t, err)
	return n
}

func exceptionText(d *runtime.ExceptionDetails) string {
	if d.Exception != nil {
		return d.Exception.Description
	}
	return ""
}

// TestConsoleSkipWithoutTokens: a server without API tokens needs no
// sign-in; the Skip form names the failed compensation, refuses a result
// that is not JSON before sending anything, shows the API's refusal of a
// result with a member twice (sent as typed, not as the browser parsed
// it), and a skip with a valid result ends the saga compensated.
func TestConsoleSkipWithoutTokens(t *testing.T) {
	t.Parallel()
	var refundDown atomic.Bool
	refundDown.Store(true)
	env := newConsoleEnv(t, consoleSaga(&refundDown), "")
	failed := env.start(t, "order-9001", 4000)
	env.waitState(t, failed, saga.StateFailed)

	b := newBrowser(t)
	b.do(t, "open the console", chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+failed))
	b.waitJS(t, "the failed saga, no sign-in", `document.querySelector('#saga-state[data-state="failed"]') !== null && document.querySelector('#token') === null`)
	require.Equal(t, "no token needed", b.text(t, "#session-state"))

	b.do(t, "open the skip form", chromedp.Click(chromedp.CSS("#repair-skip")), chromedp.WaitVisible(chromedp.CSS("#repair-step")))
	step, err := chromedp.Run(b.ctx, chromedp.Value(chromedp.CSS("#repair-step")))
	require.NoError(t, err)
	require.Equal(t, "reserve", step, "the step whose compensation failed")

	b.do(t, "a result that is not JSON", chromedp.SetValue(chromedp.CSS("#repair-result-json"), `{"refund":`),
		chromedp.Click(chromedp.CSS("#repair-send")), chromedp.WaitVisible(chromedp.CSS("#repair-error")))
	require.Contains(t, b.text(t, "#repair-error"), "Nothing was sent")

	b.do(t, "a result with a member twice", chromedp.SetValue(chromedp.CSS("#repair-result-json"), `{"refund":"R-1","refund":"R-2"}`),
		chromedp.Click(chromedp.CSS("#repair-send")))
	b.waitJS(t, "the API's refusal", `((document.querySelector('#repair-error') || {}).textContent || '').startsWith('400 ')`)
	require.Contains(t, b.text(t, "#repair-error"), `duplicate object member name "refund"`)
	b.screenshot(t, screenshotDir(t), "5-skip-refused-by-the-api")

	b.do(t, "skip with a result", chromedp.SetValue(chromedp.CSS("#repair-result-json"), `{"refund":"R-1"}`),
		chromedp.SendKeys(chromedp.CSS("#repair-reason"), "refunded by hand"),
		chromedp.Click(chromedp.CSS("#repair-send")), chromedp.WaitVisible(chromedp.CSS("#repair-ok")))
	b.waitJS(t, "the saga compensated", `document.querySelector('#saga-state[data-state="compensated"]') !== null &&
		document.querySelector('#repairs tr[data-operation="skip"]') !== null`)
	require.Contains(t, b.text(t, "#repairs"), "reserve (compensate)")
	require.Contains(t, b.text(t, "#repairs"), "refunded by hand")
	env.waitState(t, failed, saga.StateCompensated)
	b.noPageErrors(t)
}

// hostile is text an operator or a publisher could send that would run
// if the page inserted it as markup.
const hostile = `<img src=x onerror="window.pwned=1">`

// noop is a step that writes nothing.
func noop(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }

// TestConsoleSchedules drives the Schedules view and the event dead
// letters: the view lists a nightly schedule; its Pause button, reached
// and pressed from the keyboard, with a reason in markup, pauses it in
// the database with one request under the console's Idempotency-Key,
// and the page shows the reason as text; its Resume button resumes it.
// The event dead letters view shows a message that could not start a
// saga, its body as text. A parent saga's page lists its child saga and
// its steps' parallel group; the child's page links back to the parent.
func TestConsoleSchedules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	nightly := saga.WithSchedule(saga.MustNew("nightly",
		saga.Step{Name: "settle", Reaches: "settled", Kind: saga.DatabaseStep, Forward: noop}),
		saga.Schedule{Cron: "0 2 * * *"})
	incoming := saga.WithEvents(saga.MustNew("incoming",
		saga.Step{Name: "take", Reaches: "taken", Kind: saga.DatabaseStep, Forward: noop}),
		saga.Events{Subject: "consoletest.incoming"})
	fx := saga.MustNew("fx", saga.Step{Name: "quote", Reaches: "quoted", Kind: saga.DatabaseStep, Forward: noop})
	xfer := saga.MustNew("xfer",
		saga.Step{Name: "convert", Reaches: "converted", Kind: saga.ChildStep, Child: fx},
		saga.Step{Name: "credit", Group: "pay", Reaches: "paid", Kind: saga.DatabaseStep, Forward: noop},
		saga.Step{Name: "notify", Group: "pay", Reaches: "paid", Kind: saga.DatabaseStep, Forward: noop})
	var js jetstream.JetStream
	env := newConsoleEnvOf(t, apiToken, func(nc *nats.Conn) {
		var err error
		js, err = jetstream.New(nc)
		require.NoError(t, err)
		_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "CONSOLETEST", Subjects: []string{"consoletest.>"}})
		require.NoError(t, err)
	}, nightly, incoming, xfer)

	// A message without the key header cannot start a saga: kept as a
	// dead letter, with its body, markup and all.
	msg := nats.NewMsg("consoletest.incoming")
	msg.Data = []byte(hostile)
	_, err := js.PublishMsg(ctx, msg)
	require.NoError(t, err)
	deadline := time.Now().Add(15 * time.Second)
	for {
		status, body := env.send(t, http.MethodGet, "/v1/event-dead-letters", "", "", true)
		require.Equal(t, http.StatusOK, status, body)
		if strings.Contains(body, `"definition":"incoming"`) {
			break
		}
		require.True(t, time.Now().Before(deadline), "no event dead letter after 15 s: %s", body)
		time.Sleep(20 * time.Millisecond)
	}
	status, body := env.send(t, http.MethodGet, "/v1/schedules", "", "", false)
	require.Equal(t, http.StatusUnauthorized, status, "no schedule without the token: %s", body)

	b := newBrowser(t)
	b.do(t, "open the schedules", chromedp.Navigate(env.srv.URL+"/ui/#/schedules"), chromedp.WaitVisible(chromedp.CSS("#token")))
	b.do(t, "sign in", chromedp.SetValue(chromedp.CSS("#token"), apiToken), chromedp.Click(chromedp.CSS("#login-btn")))
	row := `#schedule-rows tr[data-definition="nightly"]`
	b.waitJS(t, "the nightly schedule, ticking", fmt.Sprintf(`document.querySelector('%s[data-paused="false"]') !== null`, row))
	require.Contains(t, b.text(t, row), "0 2 * * *")
	require.Contains(t, b.text(t, row), "none yet", "no saga started yet")

	// Pause from the keyboard: the button takes the focus, Enter opens
	// the form with the reason focused, Enter sends it.
	b.do(t, "pause by the keyboard", chromedp.Focus(chromedp.CSS(row+` button[data-op="pause"]`)), chromedp.KeyEvent(kb.Enter),
		chromedp.WaitVisible(chromedp.CSS("#schedule-send")))
	b.waitJS(t, "the reason focused", `document.activeElement && document.activeElement.id === 'schedule-reason'`)
	b.do(t, "send the pause", chromedp.KeyEvent(hostile+" quarter close"), chromedp.KeyEvent(kb.Enter),
		chromedp.WaitVisible(chromedp.CSS("#schedule-ok")))
	b.waitJS(t, "the schedule paused in the page", fmt.Sprintf(`document.querySelector('%s[data-paused="true"]') !== null`, row))
	require.Equal(t, hostile+" quarter close", b.text(t, row+" .paused-reason"), "the reason is shown as text")
	require.Equal(t, "http:console", b.text(t, row+" .paused-by"), "the token's name")
	require.Equal(t, 0, b.count(t, "#schedules img"), "no markup from the reason")
	b.screenshot(t, screenshotDir(t), "6-schedule-paused")

	var pausedBy, reason, pauseKey string
	require.NoError(t, env.pool.QueryRow(ctx, `select paused_by, pause_reason from idemsaga.schedules where definition = 'nightly' and paused_at is not null`).
		Scan(&pausedBy, &reason))
	require.Equal(t, "http:console", pausedBy)
	require.Equal(t, hostile+" quarter close", reason)
	require.NoError(t, env.pool.QueryRow(ctx, `select request_key from idemsaga.schedule_repairs where definition = 'nightly' and operation = 'pause'`).Scan(&pauseKey))
	require.True(t, strings.HasPrefix(pauseKey, "console-schedule-pause-"), pauseKey)
	status, body = env.send(t, http.MethodGet, "/v1/schedules", "", "", true)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `"paused":{`)

	// A pause sent again under the console's key is the same request:
	// replayed, nothing written.
	status, body = env.send(t, http.MethodPost, "/v1/schedules/nightly/pause", pauseKey,
		fmt.Sprintf(`{"reason":%q}`, hostile+" quarter close"), true)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `"replayed":true`)

	b.do(t, "resume by its button", chromedp.Click(chromedp.CSS(row+` button[data-op="resume"]`)), chromedp.WaitVisible(chromedp.CSS("#schedule-send")),
		chromedp.SendKeys(chromedp.CSS("#schedule-reason"), "quarter closed"),
		chromedp.Click(chromedp.CSS("#schedule-send")), chromedp.WaitVisible(chromedp.CSS("#schedule-ok")))
	b.waitJS(t, "the schedule ticking again in the page", fmt.Sprintf(`document.querySelector('%s[data-paused="false"]') !== null`, row))
	var paused bool
	require.NoError(t, env.pool.QueryRow(ctx, `select paused_at is not null from idemsaga.schedules where definition = 'nightly'`).Scan(&paused))
	require.False(t, paused)
	// One request per click, each under a key of the console's.
	rows, err := env.pool.Query(ctx, `select operation, request_key, reason from idemsaga.schedule_repairs where definition = 'nightly' order by created_at`)
	require.NoError(t, err)
	var ops []string
	for rows.Next() {
		var op, key, why string
		require.NoError(t, rows.Scan(&op, &key, &why))
		require.True(t, strings.HasPrefix(key, "console-schedule-"+op+"-"), key)
		ops = append(ops, op+": "+why)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"pause: " + hostile + " quarter close", "resume: quarter closed"}, ops)

	// The event dead letter, read-only, its body as text.
	b.do(t, "open the event dead letters", chromedp.Click(chromedp.CSS(`#nav a[data-view="events"]`)))
	b.waitJS(t, "the dead letter", `document.querySelector('#event-dead-letter-rows tr[data-definition="incoming"]') !== null`)
	require.Equal(t, hostile, b.text(t, `#event-dead-letter-rows tr[data-definition="incoming"] .dead-letter-body`))
	require.Contains(t, b.text(t, `#event-dead-letter-rows tr[data-definition="incoming"] .dead-letter-reason`), "has no Nats-Msg-Id header")
	require.Equal(t, 0, b.count(t, "#event-dead-letters img"), "no markup from the body")
	require.Equal(t, 0, b.count(t, "#event-dead-letters button"), "the view is read-only")
	b.screenshot(t, screenshotDir(t), "7-event-dead-letters")

	// A parent and its child, each linked from the other.
	status, body = env.send(t, http.MethodPost, "/v1/sagas/xfer", "x-1", `{}`, true)
	require.Equal(t, http.StatusCreated, status, body)
	var parent httpapi.Started
	require.NoError(t, json.Unmarshal([]byte(body), &parent))
	env.waitState(t, parent.ID.String(), "paid")
	b.do(t, "open the parent", chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+parent.ID.String()))
	b.waitJS(t, "its child listed", `document.querySelector('#children tr[data-step="convert"] a') !== null`)
	require.Contains(t, b.text(t, `#children tr[data-step="convert"]`), "quoted")
	require.Contains(t, b.text(t, `#steps tr[data-step="credit"]`), "group pay")
	require.Contains(t, b.text(t, `#steps tr[data-step="notify"]`), "group pay")
	// The plan: the child step, then the group's two branches side by
	// side in one stage.
	require.Equal(t, 2, b.count(t, `#plan .plan-group[data-group="pay"] .plan-step[data-status="succeeded"]`))
	require.Equal(t, 1, b.count(t, `#plan .plan-stage:not(.plan-group) .plan-step[data-step="convert"]`))
	require.Contains(t, b.text(t, `#plan .plan-step[data-step="convert"]`), "child quoted")
	b.screenshot(t, screenshotDir(t), "8-parent-and-child")
	b.do(t, "open the child", chromedp.Click(chromedp.CSS(`#children tr[data-step="convert"] a`)))
	b.waitJS(t, "the child's page, linked to its parent", fmt.Sprintf(`document.querySelector('#saga-parent') !== null && document.querySelector('#saga-parent').textContent === %q`, parent.ID.String()))
	require.Contains(t, b.text(t, "#saga-head"), "its step convert started this saga")
	require.NotContains(t, b.text(t, "#saga-head"), "null", "no missing field shows as null")
	require.Contains(t, b.text(t, "#saga-head"), "quoted (version ", "the state with its version")

	// A saga held by its definition's pause: its own Resume is not
	// suggested (it would answer 409); Resume definition lifts the pause.
	status, body = env.send(t, http.MethodPost, "/v1/definitions/xfer/pause", "hold-xfer", `{"reason":"bank down"}`, true)
	require.Equal(t, http.StatusOK, status, body)
	status, body = env.send(t, http.MethodPost, "/v1/sagas/xfer", "x-2", `{}`, true)
	require.Equal(t, http.StatusCreated, status, body)
	var held httpapi.Started
	require.NoError(t, json.Unmarshal([]byte(body), &held))
	b.do(t, "open the held saga", chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+held.ID.String()))
	b.waitJS(t, "the held saga's repairs", fmt.Sprintf(`document.querySelector('#saga-id') !== null && document.querySelector('#saga-id').textContent === %q &&
		!document.querySelector('#repair-resume-definition').hidden`, held.ID.String()))
	require.Equal(t, 0, b.count(t, `#repair-resume.suggested`), "the saga's own resume is not suggested")
	require.Contains(t, b.text(t, "#saga-head"), "with its definition xfer")
	b.waitJS(t, "the held step", `document.querySelector('#steps tr[data-step="convert"]') !== null`)
	require.Contains(t, b.text(t, `#steps tr[data-step="convert"]`), "held by its definition's pause", "a held step shows no lease, past or not")
	require.NotContains(t, b.text(t, "#steps"), "lease until")
	b.do(t, "resume the definition", chromedp.Click(chromedp.CSS("#repair-resume-definition")), chromedp.WaitVisible(chromedp.CSS("#repair-send")),
		chromedp.Click(chromedp.CSS("#repair-send")), chromedp.WaitVisible(chromedp.CSS("#repair-ok")))
	require.Contains(t, b.text(t, "#repair-ok"), "definition xfer resumed")
	env.waitState(t, held.ID.String(), "paid")
	b.waitJS(t, "the resume-definition button gone", `document.querySelector('#repair-resume-definition').hidden`)
	var pausedDefs int
	require.NoError(t, env.pool.QueryRow(ctx, `select count(*) from idemsaga.paused_definitions`).Scan(&pausedDefs))
	require.Zero(t, pausedDefs)

	b.waitJS(t, "nothing the page was sent ran", `window.pwned === undefined`)
	b.noPageErrors(t)
}

// TestConsoleReadToken: signed in with a token of scope read, the console
// says who it is, shows a saga without its data, and offers no repair:
// the page says which scope repairs need.
func TestConsoleReadToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	viewed := saga.MustNew("viewed", saga.Step{Name: "note", Reaches: "noted", Kind: saga.DatabaseStep, Forward: noop})
	env := newConsoleEnvOf(t, apiToken, func(*nats.Conn) {}, viewed)
	res, err := env.client.Start(ctx, viewed, "viewed-1", map[string]string{"note": "MARKER-viewer"})
	require.NoError(t, err)
	b := newBrowser(t)
	b.do(t, "open the saga", chromedp.Navigate(env.srv.URL+"/ui/#/saga/"+res.ID.String()), chromedp.WaitVisible(chromedp.CSS("#token")))
	b.do(t, "sign in as the viewer", chromedp.SetValue(chromedp.CSS("#token"), viewerToken), chromedp.Click(chromedp.CSS("#login-btn")))
	b.waitJS(t, "who is signed in", `document.querySelector('#session-state').textContent === 'signed in as viewer (read, data hidden)'`)
	b.waitJS(t, "the saga, its data hidden", `document.querySelector('#saga-redacted') !== null`)
	require.Contains(t, b.text(t, "#repair-not-allowed"), "scope operator")
	require.Equal(t, 0, b.count(t, "#repair button"), "no repair offered")
	require.NotContains(t, b.text(t, "body"), "MARKER-viewer", "no data shown")
	b.noPageErrors(t)
}
