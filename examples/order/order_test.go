package order_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
	sagaservice "github.com/idemsaga/idemsaga/service"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fault is what the network between the saga and the payment service does
// to one request.
type fault int

const (
	pass    fault = iota
	lose          // the service commits; its answer is lost
	busy          // 503 before the service sees it: nothing charged
	fail500       // 500 before the service sees it: nothing charged
	hang          // the service commits; its answer comes after the caller gave up
)

// faulty puts a script in front of the payment service: the n-th request
// (counted from 1) of a path and customer is handled as the script says.
type faulty struct {
	inner  http.Handler
	script func(path, customer string, n int) fault
	mu     sync.Mutex
	seen   map[string]int
}

func (f *faulty) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// The customer is read from the body without consuming it.
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytesReader(body))
	customer := customerOf(body)
	f.mu.Lock()
	if f.seen == nil {
		f.seen = map[string]int{}
	}
	k := r.URL.Path + "|" + customer
	f.seen[k]++
	n := f.seen[k]
	f.mu.Unlock()
	switch f.script(r.URL.Path, customer, n) {
	case busy:
		w.WriteHeader(http.StatusServiceUnavailable)
	case fail500:
		w.WriteHeader(http.StatusInternalServerError)
	case lose:
		f.inner.ServeHTTP(httptest.NewRecorder(), r)
		panic(http.ErrAbortHandler)
	case hang:
		f.inner.ServeHTTP(httptest.NewRecorder(), r)
		<-r.Context().Done()
		panic(http.ErrAbortHandler)
	default:
		f.inner.ServeHTTP(w, r)
	}
}

type env struct {
	t      *testing.T
	pool   *pgxpool.Pool
	def    *saga.Definition
	kit    *sagatest.Env
	reg    *prometheus.Registry
	policy saga.RetryPolicy
	svc    *payments.Service
	// dropConfirmations, when set, loses the service's confirmations
	// on their way: only the answers to the requests tell the saga.
	dropConfirmations *atomic.Bool
}

// policy keeps the tests quick: three attempts of half a second.
var policy = saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Timeout: 500 * time.Millisecond}

// start runs an engine with the order saga against a payment service
// behind script (nil: no faults), on stock of 100 for products 1 and 2.
func start(t *testing.T, script func(path, customer string, n int) fault, defs ...func(order.Config) (*saga.Definition, error)) *env {
	t.Helper()
	if script == nil {
		script = func(string, string, int) fault { return pass }
	}
	// The service shares the test's database, which exists once the kit
	// made it: its handler is set in Setup.
	var service atomic.Pointer[http.Handler]
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*service.Load()).ServeHTTP(w, r) }))
	t.Cleanup(srv.Close)
	newDef := order.NewDefinition
	if len(defs) > 0 {
		newDef = defs[0]
	}
	def, err := newDef(order.Config{PaymentsURL: srv.URL, Policy: policy})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	// The service confirms every charge by callback, twice, half of the
	// time before it answers the charge.
	var kitp atomic.Pointer[sagatest.Env]
	var svc *payments.Service
	drop := new(atomic.Bool)
	notify := func(ctx context.Context, n payments.Notice) error {
		if drop.Load() {
			return nil // lost on the way: the service believes it delivered
		}
		k := kitp.Load()
		if k == nil {
			return errors.New("the engine is not running yet")
		}
		_, err := k.Client.Complete(ctx, engine.Callback{Token: n.Token, EventID: n.EventID, Result: must(json.Marshal(n.Charge))})
		return err
	}
	kit := sagatest.New(t, sagatest.Config{
		Definitions: []*saga.Definition{def},
		Migrations:  []sagaservice.Migration{{Schema: order.Schema, Files: order.Migrations}, {Schema: payments.Schema, Files: payments.Migrations}},
		Registerer:  reg,
		Setup: func(ctx context.Context, pool *pgxpool.Pool) error {
			svc = payments.New(pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
			svc.SetFaults(payments.Faults{ConfirmEarly: 0.5}, 1)
			svc.SetNotifier(notify)
			var h http.Handler = &faulty{inner: svc.Handler(), script: script}
			service.Store(&h)
			return order.Seed(ctx, pool, 2, 100)
		},
	})
	kitp.Store(kit)
	t.Cleanup(svc.Close)
	return &env{t: t, pool: kit.Pool, def: def, kit: kit, reg: reg, policy: policy, svc: svc, dropConfirmations: drop}
}

// run starts an order and waits for it to finish.
func (v *env) run(key string, in order.Input) *saga.Instance {
	v.t.Helper()
	return v.kit.Run(v.t, v.def, key, in)
}

// charge reads the payment service's row of a saga's charge.
func (v *env) charge(sagaID uuid.UUID) (state string, amount int64) {
	v.t.Helper()
	key := saga.StepKey(sagaID, order.StepCharge, saga.PhaseForward)
	err := v.pool.QueryRow(context.Background(), `select state, amount from payments.charges where key = $1`, key).Scan(&state, &amount)
	if err != nil {
		return "none", 0
	}
	return state, amount
}

// audit requires the example's invariants and the engine's.
func (v *env) audit(byState map[string]int) order.Report {
	v.t.Helper()
	ctx := context.Background()
	rep, err := order.Audit(ctx, v.pool)
	require.NoError(v.t, err)
	require.Empty(v.t, rep.Differences)
	require.Equal(v.t, byState, rep.ByState)
	diffs, err := engine.Reconcile(ctx, v.pool, []*saga.Definition{v.def}, time.Minute)
	require.NoError(v.t, err)
	require.Empty(v.t, diffs)
	return rep
}

func (v *env) step(sg *saga.Instance, name string, phase saga.Phase) saga.StepExecution {
	v.t.Helper()
	for _, s := range sg.Steps {
		if s.Step == name && s.Phase == phase {
			return s
		}
	}
	v.t.Fatalf("saga %s has no step %s (%s)", sg.ID, name, phase)
	return saga.StepExecution{}
}

func ann(address string) order.Input {
	return order.Input{Customer: "ann", Product: 1, Quantity: 2, Amount: 1500, Address: address}
}

// TestOrdersEndAsTheirInputsSay runs one order of each kind: shipped, out
// of stock, declined, and undeliverable (ship fails for good: its charge
// is refunded and its stock released).
func TestOrdersEndAsTheirInputsSay(t *testing.T) {
	t.Parallel()
	v := start(t, nil)
	shipped := v.run("o-1", ann("1 Main St"))
	require.Equal(t, order.StateShipped, shipped.State)
	// The charge was confirmed by callback, twice; the first delivery of
	// the service's transaction number completed it, the second was
	// answered from its record.
	require.Len(t, shipped.Callbacks, 1)
	require.Equal(t, engine.CallbackApplied, shipped.Callbacks[0].Outcome)
	key := saga.StepKey(shipped.ID, order.StepCharge, saga.PhaseForward)
	require.Equal(t, "txn-"+key.String(), shipped.Callbacks[0].EventID)
	var confirmed payments.Confirmation
	require.NoError(t, json.Unmarshal(shipped.Results[order.StepCharge], &confirmed))
	require.Equal(t, int64(1500), confirmed.Amount)
	require.Eventually(t, func() bool { return v.svc.Counts().Confirmed == payments.Confirmations }, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, 1.0, metric(t, v.reg, "idemsaga_duplicates_absorbed_total", "layer", "callback"))
	outOfStock := v.run("o-2", order.Input{Customer: "ann", Product: 2, Quantity: 101, Amount: 9, Address: "x"})
	require.Equal(t, saga.StateCompensated, outOfStock.State)
	declined := v.run("o-3", order.Input{Customer: "declined-bob", Product: 1, Quantity: 1, Amount: 700, Address: "x"})
	require.Equal(t, saga.StateCompensated, declined.State)
	require.Contains(t, declined.Error, "card declined")
	require.False(t, v.step(declined, order.StepCharge, saga.PhaseForward).PossiblyDone, "a refusal is a known outcome")
	undeliverable := v.run("o-4", ann(order.Undeliverable))
	require.Equal(t, saga.StateCompensated, undeliverable.State)
	state, _ := v.charge(undeliverable.ID)
	require.Equal(t, "refunded", state)

	rep := v.audit(map[string]int{"shipped": 1, "compensated": 3})
	require.Equal(t, int64(1500), rep.Charged)
	// The undeliverable order's charge is refunded; the out-of-stock
	// one's, made beside its reservation, is refunded or its key voided,
	// as far as it got when the reservation failed.
	state, _ = v.charge(outOfStock.ID)
	require.Contains(t, []string{"none", "refunded", "voided"}, state)
	refunded := 1
	if state == "refunded" {
		refunded++
	}
	require.Equal(t, refunded, rep.Refunded)
	var stock int64
	require.NoError(t, v.pool.QueryRow(context.Background(), `select stock from orders.products where id = 1`).Scan(&stock))
	require.Equal(t, int64(98), stock, "only the shipped order keeps its stock")
}

// TestDigitalOrdersSkipShipping runs a digital order, which skips the
// ship step (decided once, when its charge was recorded), and a declined
// digital one, whose compensation passes the skipped step over.
func TestDigitalOrdersSkipShipping(t *testing.T) {
	t.Parallel()
	v := start(t, nil)
	ebook := order.Input{Customer: "ann", Product: 1, Quantity: 1, Amount: 900, Digital: true}
	done := v.run("d-1", ebook)
	require.Equal(t, order.StateShipped, done.State, "a skipped step's state is reached at once")
	require.Equal(t, []string{order.StepShip}, done.Skipped)
	require.Equal(t, saga.StepSkipped, v.step(done, order.StepShip, saga.PhaseForward).Status)
	require.NotContains(t, done.Results, order.StepShip)
	var shipments int
	require.NoError(t, v.pool.QueryRow(context.Background(), `select count(*) from orders.shipments where saga_id = $1`, done.ID).Scan(&shipments))
	require.Zero(t, shipments)

	ebook.Customer = "declined-bob"
	declined := v.run("d-2", ebook)
	require.Equal(t, saga.StateCompensated, declined.State)
	require.Empty(t, declined.Skipped, "ship's condition is decided by the charge's success, which never came")

	_, err := v.kit.Client.Start(context.Background(), v.def, "d-3", order.Input{Customer: "ann", Product: 1, Quantity: 1, Amount: 900})
	require.ErrorContains(t, err, "a physical order needs one", "a physical order without an address is refused")

	rep := v.audit(map[string]int{"shipped": 1, "compensated": 1})
	require.Equal(t, int64(900), rep.Charged)
}

// withoutVerify is the order saga without its charge's Verify: the give-up
// rule alone.
func withoutVerify(cfg order.Config) (*saga.Definition, error) {
	cfg.WithoutVerify = true
	return order.NewDefinition(cfg)
}

// TestGiveUpRule: a charge any of whose attempts had an unknown outcome
// is possibly done; when it is given up, its refund runs first, under its
// own key, then the reservation is released, whatever the last attempt
// said. Each cause of an unknown outcome, and the clean refusal after
// one.
func TestGiveUpRule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		charge func(n int) fault
		// charged is whether the service ever took the money (refunded
		// after), against a key only voided.
		charged bool
	}{
		{"the response lost on every attempt", func(int) fault { return lose }, true},
		{"a timeout on the last attempt", func(n int) fault { return map[int]fault{1: busy, 2: busy, 3: hang}[n] }, true},
		{"a clean 503 on the last attempt after an earlier lost response", func(n int) fault { return map[int]fault{1: lose, 2: busy, 3: busy}[n] }, true},
		{"a 500 on the last attempt after an earlier lost response", func(n int) fault { return map[int]fault{1: lose, 2: fail500, 3: fail500}[n] }, true},
		{"500s that never charged", func(int) fault { return fail500 }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := start(t, func(path, _ string, n int) fault {
				if path == "/charges" {
					return tc.charge(n)
				}
				return pass
			}, withoutVerify)
			// The confirmations are lost too: nothing tells the saga the
			// charge went through.
			v.dropConfirmations.Store(true)
			sg := v.run("given-up", ann("1 Main St"))
			require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
			charge := v.step(sg, order.StepCharge, saga.PhaseForward)
			require.Equal(t, saga.StepFailed, charge.Status)
			require.True(t, charge.PossiblyDone)
			require.Contains(t, sg.Error, charge.Key.String(), "the error names the key to check")
			refund := v.step(sg, order.StepCharge, saga.PhaseCompensate)
			require.Equal(t, saga.StepSucceeded, refund.Status, "the possibly-done charge was refunded first")
			// The reservation runs beside the charge: on a busy machine
			// the charge can be given up before it ran, and then there
			// is nothing to release (the audit checks the stock).
			if v.step(sg, order.StepReserve, saga.PhaseForward).Status == saga.StepSucceeded {
				require.Equal(t, saga.StepSucceeded, v.step(sg, order.StepReserve, saga.PhaseCompensate).Status, "then the stock released")
			}
			state, _ := v.charge(sg.ID)
			if tc.charged {
				require.Equal(t, "refunded", state, "the charge that went through is refunded")
			} else {
				require.Equal(t, "voided", state, "undoing what never happened is harmless")
			}
			v.audit(map[string]int{"compensated": 1})
		})
	}
}

// TestLeaseExpiryOnTheLastAttempt: every attempt's worker dies after the
// call took effect and before it recorded the outcome, so each lease
// expires; without Verify the reaper gives the step up as possibly done,
// and the refund runs first.
func TestLeaseExpiryOnTheLastAttempt(t *testing.T) {
	t.Parallel()
	v := start(t, nil, withoutVerify)
	v.dropConfirmations.Store(true)
	v.kit.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: order.StepCharge, Times: policy.MaxAttempts})
	sg := v.run("lease", ann("1 Main St"))
	require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
	// Each attempt that ran called and recorded nothing. On a busy
	// machine one can be taken over before its worker ran it (CI saw 2
	// of 3): it recorded nothing either.
	require.Positive(t, v.kit.Fired(sagatest.LoseOutcome), "attempts called, and recorded nothing")
	require.LessOrEqual(t, v.kit.Fired(sagatest.LoseOutcome), policy.MaxAttempts)
	require.True(t, v.step(sg, order.StepCharge, saga.PhaseForward).PossiblyDone)
	require.Contains(t, sg.Error, "no reply after 3 attempts")
	state, _ := v.charge(sg.ID)
	require.Equal(t, "refunded", state)
	require.Equal(t, 3.0, metric(t, v.reg, "idemsaga_lease_takeovers_total"), "two takeovers and the give-up")
	v.audit(map[string]int{"compensated": 1})
}

// TestPossiblyDoneWithoutCompensationParks: a charge without a refund
// whose answers are lost cannot be undone: the saga parks, nothing is
// compensated (the stock stays reserved), the error names the key, the
// metric counts it and reconcile lists it. An operator's retry then sends
// the charge again under the same key; the service answers with the
// charge it made, and the order ships.
func TestPossiblyDoneWithoutCompensationParks(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	losing := true
	v := start(t, func(path, _ string, _ int) fault {
		mu.Lock()
		defer mu.Unlock()
		if path == "/charges" && losing {
			return lose
		}
		return pass
	}, func(cfg order.Config) (*saga.Definition, error) {
		d, err := order.NewDefinition(cfg)
		if err != nil {
			return nil, err
		}
		steps := d.Steps()
		steps[1].Compensate = nil // no refund
		return saga.New(order.DefinitionName, steps...)
	})
	ctx := context.Background()
	v.dropConfirmations.Store(true)
	sg := v.run("parked", ann("1 Main St"))
	require.Equal(t, saga.StateParked, sg.State)
	charge := v.step(sg, order.StepCharge, saga.PhaseForward)
	require.True(t, charge.PossiblyDone)
	require.Contains(t, sg.Error, charge.Key.String())
	require.Contains(t, sg.Error, "`retry "+sg.ID.String()+"`")
	for _, s := range sg.Steps {
		require.NotEqual(t, saga.PhaseCompensate, s.Phase, "nothing is compensated")
	}
	var reserved int
	require.NoError(t, v.pool.QueryRow(ctx, `select count(*) from orders.reservations where saga_id = $1`, sg.ID).Scan(&reserved))
	require.Equal(t, 1, reserved, "the stock stays reserved")
	require.Equal(t, 1.0, metric(t, v.reg, "idemsaga_sagas_finished_total", "outcome", "parked"))
	diffs, err := engine.Reconcile(ctx, v.pool, []*saga.Definition{v.def}, time.Minute)
	require.NoError(t, err)
	require.Len(t, diffs, 1)
	require.Contains(t, diffs[0].What, "parked and needs a person")
	parked, err := v.kit.Client.List(ctx, engine.ListOptions{State: saga.StateParked})
	require.NoError(t, err)
	require.Len(t, parked, 1)

	v.dropConfirmations.Store(false)
	mu.Lock()
	losing = false
	mu.Unlock()
	_, err = v.kit.Client.Retry(ctx, sg.ID, engine.Repair{})
	require.NoError(t, err)
	done := v.kit.Wait(t, sg.ID)
	require.Equal(t, order.StateShipped, done.State, done.Error)
	state, amount := v.charge(sg.ID)
	require.Equal(t, []any{"charged", int64(1500)}, []any{state, amount}, "charged once, under the one key")
	v.audit(map[string]int{"shipped": 1})
}

// TestRefundThatLosesResponses: the order cannot ship, so its charge is
// refunded; the refund's answers are lost twice, and it is retried under
// its own key until one comes back: refunded once. When every answer is
// lost, the compensation cannot finish and the saga fails, visibly.
func TestRefundThatLosesResponses(t *testing.T) {
	t.Parallel()
	for _, always := range []bool{false, true} {
		name := "twice"
		if always {
			name = "always"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			v := start(t, func(path, _ string, n int) fault {
				if path == "/refunds" && (always || n <= 2) {
					return lose
				}
				return pass
			})
			sg := v.run("refund", ann(order.Undeliverable))
			state, _ := v.charge(sg.ID)
			require.Equal(t, "refunded", state, "the refund took effect, once")
			if !always {
				require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
				v.audit(map[string]int{"compensated": 1})
				return
			}
			require.Equal(t, saga.StateFailed, sg.State)
			require.Contains(t, sg.Error, "may have taken effect")
			require.True(t, v.step(sg, order.StepCharge, saga.PhaseCompensate).PossiblyDone)
			rep, err := order.Audit(context.Background(), v.pool)
			require.NoError(t, err)
			require.Len(t, rep.Differences, 1)
			require.Contains(t, rep.Differences[0], "failed and needs a person")
		})
	}
}

// metric sums a counter over the label pair given, if any.
func metric(t *testing.T, reg *prometheus.Registry, name string, label ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	total := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if len(label) == 2 && !hasLabel(m, label[0], label[1]) {
				continue
			}
			total += m.GetCounter().GetValue()
		}
	}
	return total
}

func hasLabel(m *dto.Metric, k, v string) bool {
	for _, l := range m.GetLabel() {
		if l.GetName() == k && l.GetValue() == v {
			return true
		}
	}
	return false
}

// TestConfirmationsBeforeTheAnswerAndTwice: the payment service confirms
// every charge before it answers the charge request, and once more after;
// orders run side by side. Each early confirmation is kept until its step
// waits, each second one is absorbed, and every order ships once.
func TestConfirmationsBeforeTheAnswerAndTwice(t *testing.T) {
	t.Parallel()
	v := start(t, nil)
	v.svc.SetFaults(payments.Faults{ConfirmEarly: 1}, 3)
	ctx := context.Background()
	const n = 12
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := v.kit.Client.Start(ctx, v.def, fmt.Sprintf("early-%d", i), order.Input{Customer: "ann", Product: 1 + int64(i%2), Quantity: 1, Amount: 100, Address: "1 Main St"})
			if err == nil {
				ids[i] = res.ID
			}
		}()
	}
	wg.Wait()
	for _, id := range ids {
		require.NotEqual(t, uuid.Nil, id)
		sg := v.kit.Wait(t, id)
		require.Equal(t, order.StateShipped, sg.State, sg.Error)
		require.Len(t, sg.Callbacks, 1)
		require.Equal(t, engine.CallbackApplied, sg.Callbacks[0].Outcome)
	}
	require.Equal(t, float64(n), metric(t, v.reg, "idemsaga_callbacks_total", "outcome", "pending"), "every first confirmation came before its step waited")
	require.Eventually(t, func() bool { return v.svc.Counts().Confirmed == n*payments.Confirmations }, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, float64(n), metric(t, v.reg, "idemsaga_duplicates_absorbed_total", "layer", "callback"))
	rep := v.audit(map[string]int{"shipped": n})
	require.Equal(t, int64(100*n), rep.Charged)
}

// recorder is a transport that keeps the status of every charge answered.
type recorder struct {
	mu      sync.Mutex
	charges []int
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err == nil && req.URL.Path == "/charges" {
		r.mu.Lock()
		r.charges = append(r.charges, resp.StatusCode)
		r.mu.Unlock()
	}
	return resp, err
}

func (r *recorder) last() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.charges) == 0 {
		return 0
	}
	return r.charges[len(r.charges)-1]
}

// TestCompensationClosesTheDoor: a charge given up as possibly done is
// refunded by its key, which voids the key when the charge never came;
// the test kit's LateForward then sends the charge again after the
// refund, as a request held on the way would arrive, and the payment
// service refuses it (409). A refund that only "undoes what happened"
// leaves the door open: the same late charge takes the money, and the
// audit sees an order charged and compensated.
func TestCompensationClosesTheDoor(t *testing.T) {
	t.Parallel()
	for _, closes := range []bool{true, false} {
		name := "the refund voids the key"
		if !closes {
			name = "a refund that leaves the key open"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rec := &recorder{}
			// Every charge attempt fails (however many reached the
			// service: a busy machine's attempt may time out before its
			// request); only the late charge, sent once the compensation
			// ran, passes.
			var kit atomic.Pointer[sagatest.Env]
			v := start(t, func(path, _ string, n int) fault {
				if path == "/charges" && (kit.Load() == nil || kit.Load().Fired(sagatest.LateForward) == 0) {
					return fail500 // never charged; the engine cannot know
				}
				return pass // the late charge reaches the service
			}, func(cfg order.Config) (*saga.Definition, error) {
				cfg.Transport, cfg.WithoutVerify = rec, true
				d, err := order.NewDefinition(cfg)
				if err != nil || closes {
					return d, err
				}
				steps := d.Steps()
				steps[1].Compensate = func(context.Context, *saga.StepContext) (json.RawMessage, error) {
					return nil, nil // nothing was charged that it knows of
				}
				return saga.New(order.DefinitionName, steps...)
			})
			v.dropConfirmations.Store(true)
			kit.Store(v.kit)
			v.kit.Inject(sagatest.Fault{Kind: sagatest.LateForward, Step: order.StepCharge})
			sg := v.run("late", ann("1 Main St"))
			require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
			require.Equal(t, 1, v.kit.Fired(sagatest.LateForward))
			if closes {
				require.Eventually(t, func() bool { return rec.last() == http.StatusConflict }, 30*time.Second, 10*time.Millisecond, "the late charge is refused")
				state, _ := v.charge(sg.ID)
				require.Equal(t, "voided", state)
				v.audit(map[string]int{"compensated": 1})
				return
			}
			require.Eventually(t, func() bool { return rec.last() == http.StatusCreated }, 30*time.Second, 10*time.Millisecond, "the late charge takes the money")
			state, _ := v.charge(sg.ID)
			require.Equal(t, "charged", state)
			rep, err := order.Audit(context.Background(), v.pool)
			require.NoError(t, err)
			require.NotEmpty(t, rep.Differences, "the audit sees the money taken from a compensated order")
		})
	}
}

// TestVerifyAsksThePaymentService: with the charge's Verify, an unknown
// outcome is decided by asking the service about the key. Charges made
// whose answers were lost are found (one charge request, no refund, the
// order ships); 500s that never charged are found absent, so the charge
// is not possibly done: the order is compensated, and its refund only
// voids the key (against a charge request still on its way).
func TestVerifyAsksThePaymentService(t *testing.T) {
	t.Parallel()
	t.Run("charged, every answer lost", func(t *testing.T) {
		t.Parallel()
		rec := &recorder{}
		v := start(t, func(path, _ string, _ int) fault {
			if path == "/charges" {
				return lose
			}
			return pass
		}, func(cfg order.Config) (*saga.Definition, error) { cfg.Transport = rec; return order.NewDefinition(cfg) })
		sg := v.run("verified", ann("1 Main St"))
		require.Equal(t, order.StateShipped, sg.State, sg.Error)
		charge := v.step(sg, order.StepCharge, saga.PhaseForward)
		require.False(t, charge.PossiblyDone)
		rec.mu.Lock()
		require.Len(t, rec.charges, 0, "the lost answer is no status; Verify found the charge: no second request")
		rec.mu.Unlock()
		state, _ := v.charge(sg.ID)
		require.Equal(t, "charged", state)
		require.Equal(t, 1.0, metric(t, v.reg, "idemsaga_verified_total", "answer", "done"))
		v.audit(map[string]int{"shipped": 1})
	})
	t.Run("500s that never charged", func(t *testing.T) {
		t.Parallel()
		v := start(t, func(path, _ string, _ int) fault {
			if path == "/charges" {
				return fail500
			}
			return pass
		})
		v.dropConfirmations.Store(true)
		sg := v.run("verified", ann("1 Main St"))
		require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
		charge := v.step(sg, order.StepCharge, saga.PhaseForward)
		require.Equal(t, saga.StepFailed, charge.Status)
		require.False(t, charge.PossiblyDone, "the service said, for each attempt, that the key charged nothing")
		require.Equal(t, saga.StepSucceeded, v.step(sg, order.StepCharge, saga.PhaseCompensate).Status, "the refund closed the door")
		state, amount := v.charge(sg.ID)
		require.Equal(t, []any{"voided", int64(0)}, []any{state, amount}, "nothing charged, the key voided")
		require.Equal(t, float64(policy.MaxAttempts), metric(t, v.reg, "idemsaga_verified_total", "answer", "not_done"))
		v.audit(map[string]int{"compensated": 1})
	})
}
