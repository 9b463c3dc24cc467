package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

// chaosWorkload is what a chaos run submits and checks.
type chaosWorkload interface {
	// prepare seeds the database and starts what the workers call.
	prepare(ctx context.Context, pool *pgxpool.Pool, seed uint64) error
	// env is what the workers need besides the engine's settings.
	env() []string
	count(c *chaosCmd) int
	describe()
	definition(policy saga.RetryPolicy) (*saga.Definition, error)
	// connect gives the workload the harness's client, once it exists.
	connect(client *engine.Client)
	jobs(n int, seed uint64) []chaosJob
	// check reconciles the run into fig.
	check(ctx context.Context, pool *pgxpool.Pool, def *saga.Definition, fig *chaosFigures) error
	close()
}

// transferChaos runs transfers: 10% fail at credit (the frozen account).
type transferChaos struct{ seeded int64 }

const chaosAccounts = 50

func (w *transferChaos) prepare(ctx context.Context, pool *pgxpool.Pool, _ uint64) (err error) {
	w.seeded, err = transfer.Seed(ctx, pool, chaosAccounts+1, 1_000_000, chaosAccounts+1)
	return err
}

func (w *transferChaos) env() []string          { return nil }
func (w *transferChaos) count(c *chaosCmd) int  { return c.Transfers }
func (w *transferChaos) describe()              {}
func (w *transferChaos) close()                 {}
func (w *transferChaos) connect(*engine.Client) {}

func (w *transferChaos) definition(p saga.RetryPolicy) (*saga.Definition, error) {
	return transfer.NewDefinition(p)
}

// chaosTransfer draws the i-th transfer of a run between two of the
// seeded accounts; one in ten goes to the frozen account, whose credit
// fails.
func chaosTransfer(rng *rand.Rand, i int) (from, to, amount int64) {
	from = 1 + rng.Int64N(chaosAccounts)
	to = 1 + (from+rng.Int64N(chaosAccounts-1))%chaosAccounts
	if i%10 == 3 {
		to = chaosAccounts + 1
	}
	return from, to, 1 + rng.Int64N(500)
}

func (w *transferChaos) jobs(n int, seed uint64) []chaosJob {
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	jobs := make([]chaosJob, n)
	for i := range jobs {
		from, to, amount := chaosTransfer(rng, i)
		jobs[i] = chaosJob{key: fmt.Sprintf("chaos-%06d", i), in: transfer.Input{From: from, To: to, Amount: amount}}
	}
	return jobs
}

func (w *transferChaos) check(ctx context.Context, pool *pgxpool.Pool, def *saga.Definition, fig *chaosFigures) error {
	res, err := reconcile(ctx, pool, []*saga.Definition{def}, 5*time.Second, w.seeded)
	if err != nil {
		return err
	}
	fig.ByState = res.Sagas
	fig.Sagas = res.Sagas["credited"] + res.Sagas["compensated"] + res.Sagas["failed"]
	fig.Credited, fig.Compensated, fig.Failed = res.Sagas["credited"], res.Sagas["compensated"], res.Sagas["failed"]
	for _, d := range res.Differences {
		fig.Differences = append(fig.Differences, d.String())
	}
	return nil
}

// orderChaos runs orders against the example payment service, which the
// harness runs in its own process (the workers reach it over loopback),
// losing answers after it charged, failing before it charged, and
// answering some charges after the step's timeout.
type orderChaos struct {
	// noVerify leaves out the charge's Verify (chaos --no-verify); naive,
	// noRefund, orderRate and calm are chaos's --naive, --no-refund,
	// --order-rate and --calm, rateLimit the service's --rate-limit.
	noVerify, naive, noRefund, external, calm bool
	rateLimit, orderRate                      int
	svc                                       *payments.Service
	srv                                       *http.Server
	url                                       string
	client                                    atomic.Pointer[engine.Client]
}

// chaosChargeWait is how long an order of a chaos run waits for its
// charge's confirmation: both of a charge's confirmations are sometimes
// lost, and the run must end.
const chaosChargeWait = 15 * time.Second

// Customers the service always loses the answers of: their charges
// commit every time and no attempt ever learns it.
var chaosUnlucky = []string{"unlucky-1", "unlucky-2"}

const chaosProducts = 20

func (w *orderChaos) prepare(ctx context.Context, pool *pgxpool.Pool, seed uint64) error {
	if err := order.Seed(ctx, pool, chaosProducts, 1_000_000); err != nil {
		return err
	}
	w.svc = payments.New(pool, slog.New(slog.DiscardHandler))
	faults := payments.Faults{
		LoseResponse: 0.05, AlwaysLoseFor: chaosUnlucky, FailBefore: 0.04, Busy: 0.03,
		Slow: chaosStepTimeout + 500*time.Millisecond, SlowP: 0.02, Refunds: true,
		ConfirmEarly: 0.3, LoseConfirmation: 0.1,
		// A charge on a reused connection that commits and drops it
		// (where Go's transport resends on its own), and a charge that
		// commits after its attempt's timeout, maybe after its refund.
		DropReused: 0.03, LateCommit: chaosStepTimeout + time.Second, LateCommitP: 0.02,
	}
	if w.calm {
		faults = payments.Faults{}
	}
	faults.RateLimit = w.rateLimit
	w.svc.SetFaults(faults, seed)
	// The service confirms charges to the harness's own engine client,
	// as it would to any process of the deployment's API.
	w.svc.SetNotifier(func(ctx context.Context, n payments.Notice) error {
		client := w.client.Load()
		if client == nil {
			return errors.New("the harness's client is not ready")
		}
		result, err := json.Marshal(n.Charge)
		if err != nil {
			return err
		}
		_, err = client.Complete(ctx, engine.Callback{Token: n.Token, EventID: n.EventID, Result: result})
		return err
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	w.url = "http://" + ln.Addr().String()
	w.srv = &http.Server{Handler: w.svc.Handler(), ReadHeaderTimeout: 5 * time.Second, ConnContext: w.svc.ConnContext}
	go func() { _ = w.srv.Serve(ln) }()
	return nil
}

func (w *orderChaos) env() []string {
	return []string{"IDEMSAGA_PAYMENTS_URL=" + w.url, "IDEMSAGA_CHARGE_WAIT=" + chaosChargeWait.String(),
		fmt.Sprintf("IDEMSAGA_ORDER_VERIFY=%t", !w.noVerify), fmt.Sprintf("IDEMSAGA_ORDER_NAIVE=%t", w.naive),
		fmt.Sprintf("IDEMSAGA_ORDER_NO_REFUND=%t", w.noRefund), fmt.Sprintf("IDEMSAGA_ORDER_EXTERNAL=%t", w.external), fmt.Sprintf("IDEMSAGA_ORDER_RATE=%d", w.orderRate)}
}
func (w *orderChaos) connect(client *engine.Client) { w.client.Store(client) }
func (w *orderChaos) count(c *chaosCmd) int         { return c.Orders }

func (w *orderChaos) describe() {
	if w.calm {
		fmt.Printf("  payment service at %s: no faults\n", w.url)
	} else {
		fmt.Printf("  payment service at %s: 5%% of answers lost after the charge or refund committed (always for %v), 4%% 500 before charging, 3%% 503, 2%% answered after the step timeout;\n"+
			"  3%% of charges on a reused connection committed and the connection dropped (the next request under the key meets a 503), 2%% committed after the step timeout;\n"+
			"  each charge confirmed by callback twice, 30%% of them first before the answer, 10%% of confirmations lost\n",
			w.url, chaosUnlucky)
	}
	if w.rateLimit > 0 {
		fmt.Printf("  the payment service answers 429 above %d requests per second\n", w.rateLimit)
	}
	fmt.Printf("  orders: Verify %t, %s client, refund %t, charge confirmed by callback %t, at most %d calls per second (0: no limit)\n",
		!w.noVerify, map[bool]string{true: "naive", false: "httpcall"}[w.naive], !w.noRefund, !w.external, w.orderRate)
}

func (w *orderChaos) close() {
	if w.srv != nil {
		_ = w.srv.Close()
	}
	if w.svc != nil {
		w.svc.Close()
	}
}

func (w *orderChaos) definition(p saga.RetryPolicy) (*saga.Definition, error) {
	x := exampleFlags{PaymentsURL: w.url, ChargeWait: chaosChargeWait, OrderVerify: !w.noVerify, OrderNaive: w.naive, OrderNoRefund: w.noRefund, OrderExternal: w.external, OrderRate: w.orderRate, UndoAttempts: 10}
	return order.NewDefinition(x.orderConfig(p))
}

func (w *orderChaos) jobs(n int, seed uint64) []chaosJob {
	rng := rand.New(rand.NewPCG(seed, uint64(n)+1))
	jobs := make([]chaosJob, n)
	for i := range jobs {
		in := order.Input{Customer: fmt.Sprintf("cust-%d", i%97), Product: 1 + rng.Int64N(chaosProducts),
			Quantity: 1 + rng.Int64N(3), Amount: 100 + rng.Int64N(10_000), Address: fmt.Sprintf("%d Main St", i)}
		switch {
		case i%100 == 7:
			in.Customer = chaosUnlucky[i%len(chaosUnlucky)]
		case i%50 == 11:
			in.Customer = "declined-" + in.Customer
		case i%20 == 13 && !w.noRefund:
			// Without a refund, a charge whose order cannot ship stays.
			in.Address = order.Undeliverable
		case i%100 == 41:
			in.Quantity = 2_000_000 // out of stock
		case i%5 == 2:
			in.Digital, in.Address = true, "" // shipping is skipped
		}
		jobs[i] = chaosJob{key: fmt.Sprintf("chaos-order-%06d", i), in: in}
	}
	return jobs
}

func (w *orderChaos) check(ctx context.Context, pool *pgxpool.Pool, def *saga.Definition, fig *chaosFigures) error {
	res, err := reconcile(ctx, pool, []*saga.Definition{def}, 5*time.Second, 0)
	if err != nil {
		return err
	}
	for _, d := range res.Differences {
		// Without a refund an order whose charge may have happened parks
		// for a person by design: counted below, not a difference.
		if w.noRefund && (d.Check == "parked" || d.Check == "order" && strings.Contains(d.What, " is parked and needs a person")) {
			continue
		}
		fig.Differences = append(fig.Differences, d.String())
	}
	if res.Order == nil {
		fig.Differences = append(fig.Differences, "no order was audited")
		return nil
	}
	rep := res.Order
	fig.ByState = rep.ByState
	for _, n := range rep.ByState {
		fig.Sagas += n
	}
	fig.Credited, fig.Compensated, fig.Failed = rep.ByState[string(order.StateShipped)], rep.ByState["compensated"], rep.ByState["failed"]
	var possiblyDone, unlucky, declined, undeliverable, outOfStock int
	if err := pool.QueryRow(ctx, `select
  (select count(*) from idemsaga.steps where step = 'charge' and phase = 'forward' and possibly_done),
  (select count(*) from idemsaga.sagas where state = 'compensated' and input->>'customer' like 'unlucky-%'),
  (select count(*) from idemsaga.sagas where state = 'compensated' and error like '%card declined%'),
  (select count(*) from idemsaga.sagas where state = 'compensated' and error like '%cannot be delivered%'),
  (select count(*) from idemsaga.sagas where state = 'compensated' and error like '%out of stock%')`).Scan(&possiblyDone, &unlucky, &declined, &undeliverable, &outOfStock); err != nil {
		return err
	}
	c := w.svc.Counts()
	fig.Extra = append(fig.Extra,
		fmt.Sprintf("orders             shipped %d; compensated %d (declined %d, undeliverable %d, out of stock %d, answers always lost %d, the rest given up after unknown outcomes)",
			fig.Credited, fig.Compensated, declined, undeliverable, outOfStock, unlucky),
		fmt.Sprintf("payment service    %d charges, %d refunds, %d answers lost after commit, %d 500s and %d 503s before charging, %d slow answers, %d replays of a key",
			c.Charges, c.Refunds, c.LostResponses, c.FailedBefore, c.Busy, c.Slow, c.Replays),
		fmt.Sprintf("charges recovered  %d charge steps possibly done; %d charges refunded, %d keys voided before any charge; held %d = shipped %d + parked %d",
			possiblyDone, rep.Refunded, rep.Voided, rep.Charged, rep.Shipped, rep.ParkedHeld),
		fmt.Sprintf("boundary           %d charges dropped on a reused connection (%d requests under their key met a 503 after it), %d charges committed late (%d refused: their key was voided first), %d answered 429 of %d requests",
			c.DroppedReused, c.BusyAfterDrop, c.LateCharges, c.LateRefused, c.RateLimited, c.Requests),
		fmt.Sprintf("verify             answers done %.0f, not done %.0f, cannot tell %.0f; orders parked %d (of them charged %d, not charged %d)",
			fig.Verified["done"], fig.Verified["not_done"], fig.Verified["unknown"], rep.Parked, rep.ParkedCharged, rep.Parked-rep.ParkedCharged),
	)
	var chargedNotRefunded, shippedRefunded, attempts, maxAttempt, digital int
	if err := pool.QueryRow(ctx, `select
  count(*) filter (where s.state = 'compensated' and c.state = 'charged'),
  count(*) filter (where s.state = 'shipped' and c.state in ('refunded', 'voided')),
  coalesce(sum(st.attempt), 0), coalesce(max(st.attempt), 0),
  count(*) filter (where s.state = 'shipped' and 'ship' = any(s.skipped))
from idemsaga.sagas s
join idemsaga.steps st on st.saga_id = s.id and st.step = 'charge' and st.phase = 'forward'
left join payments.charges c on c.key = st.key
where s.definition = 'order'`).Scan(&chargedNotRefunded, &shippedRefunded, &attempts, &maxAttempt, &digital); err != nil {
		return err
	}
	var reserveUndone, chargeUndone, bothUndone int
	if err := pool.QueryRow(ctx, `select
  count(*) filter (where r.status = 'succeeded'),
  count(*) filter (where c.status = 'succeeded'),
  count(*) filter (where r.status = 'succeeded' and c.status = 'succeeded')
from idemsaga.sagas s
left join idemsaga.steps r on r.saga_id = s.id and r.step = 'reserve' and r.phase = 'compensate'
left join idemsaga.steps c on c.saga_id = s.id and c.step = 'charge' and c.phase = 'compensate'
where s.definition = 'order' and s.state = 'compensated'`).Scan(&reserveUndone, &chargeUndone, &bothUndone); err != nil {
		return err
	}
	fig.Extra = append(fig.Extra,
		fmt.Sprintf("branches           of the compensated orders' parallel group, reserve undone %d, charge refunded or voided %d, both %d", reserveUndone, chargeUndone, bothUndone),
		fmt.Sprintf("money              charged and not refunded %d, shipped and refunded %d (both must be 0)", chargedNotRefunded, shippedRefunded),
		fmt.Sprintf("plan               %d digital orders completed with shipping skipped (their condition decided once)", digital),
		fmt.Sprintf("charge attempts    %d for %d charge steps (at most %d on one); %.0f turns waited for the payments limit; %.1f orders per second",
			attempts, fig.Sagas, maxAttempt, fig.LimitWaits, float64(fig.Sagas)/fig.WallTime.Seconds()),
	)
	var applied, pending, late, superseded, waitsRanOut int
	if err := pool.QueryRow(ctx, `select
  count(*) filter (where outcome = 'applied'), count(*) filter (where outcome = 'pending'),
  count(*) filter (where outcome = 'late'), count(*) filter (where outcome = 'superseded'),
  (select count(*) from idemsaga.sagas where error like '%no callback within%')
from idemsaga.callbacks`).Scan(&applied, &pending, &late, &superseded, &waitsRanOut); err != nil {
		return err
	}
	fig.Extra = append(fig.Extra,
		fmt.Sprintf("confirmations      %d delivered (%d deliveries failed and were sent again, %d lost on the way); events: %d completed a charge, %d kept for a step that never waited, %d late, %d superseded; %d orders heard no confirmation within %s and were refunded",
			c.Confirmed, c.ConfirmFailures, c.ConfirmationsLost, applied, pending, late, superseded, waitsRanOut, chaosChargeWait))
	return nil
}

// crossborderChaos runs cross-border transfers: two in three cross
// currencies and run the FX child; 10% fail at credit (the frozen
// account), after their child converted, which is then compensated
// whole. Half of them are started by events the harness publishes on
// the workers' --crossborder-events subject (each under its
// Transfer-Key header, those submitted twice published twice), the
// other half by the client.
type crossborderChaos struct {
	nc *nats.Conn
	js jetstream.JetStream
}

const (
	chaosEventStream  = "CHAOSEVENTS"
	chaosEventSubject = "chaos.events.crossborder"
)

// withNATS makes the stream that holds the events, and the publisher's
// connection, which keeps reconnecting through the NATS restart.
func (w *crossborderChaos) withNATS(ctx context.Context, url string) error {
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		return fmt.Errorf("connect the event publisher: %w", err)
	}
	js, err := jetstream.New(nc)
	if err == nil {
		_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: chaosEventStream, Subjects: []string{"chaos.events.>"}, Storage: jetstream.FileStorage})
	}
	if err != nil {
		nc.Close()
		return fmt.Errorf("create the event stream: %w", err)
	}
	w.nc, w.js = nc, js
	return nil
}

func (w *crossborderChaos) prepare(ctx context.Context, pool *pgxpool.Pool, _ uint64) error {
	// The desk holds enough of each currency for every conversion.
	return crossborder.Seed(ctx, pool, chaosAccounts+1, 1_000_000, 1_000_000_000, chaosAccounts+1)
}

func (w *crossborderChaos) env() []string {
	return []string{"IDEMSAGA_CROSSBORDER_EVENTS=" + chaosEventSubject}
}
func (w *crossborderChaos) count(c *chaosCmd) int  { return c.Transfers }
func (w *crossborderChaos) connect(*engine.Client) {}

func (w *crossborderChaos) describe() {
	fmt.Printf("  half the transfers started by events on %s (stream %s), keyed by their %s header\n", chaosEventSubject, chaosEventStream, crossborderKeyHeader)
}

func (w *crossborderChaos) close() {
	if w.nc != nil {
		w.nc.Close()
	}
}

func (w *crossborderChaos) definition(p saga.RetryPolicy) (*saga.Definition, error) {
	x := exampleFlags{CrossborderEvents: chaosEventSubject}
	return x.crossborder(p)
}

// publish is a job's start by event: its input published under its key,
// without JetStream's own deduplication, so that a message published
// twice reaches the workers twice.
func (w *crossborderChaos) publish(key string, in crossborder.Input) func(context.Context) error {
	return func(ctx context.Context) error {
		body, err := json.Marshal(in)
		if err != nil {
			return err
		}
		msg := nats.NewMsg(chaosEventSubject)
		msg.Header.Set(crossborderKeyHeader, key)
		msg.Data = body
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err = w.js.PublishMsg(pctx, msg)
		return err
	}
}

func (w *crossborderChaos) jobs(n int, seed uint64) []chaosJob {
	rng := rand.New(rand.NewPCG(seed, uint64(n)+2))
	jobs := make([]chaosJob, n)
	for i := range jobs {
		from, to, amount := chaosTransfer(rng, i)
		in := crossborder.Input{From: from, To: to, Amount: amount}
		jobs[i] = chaosJob{key: fmt.Sprintf("chaos-xb-%06d", i), in: in}
		if i%2 == 0 {
			jobs[i].key = fmt.Sprintf("chaos-xb-event-%06d", i)
			jobs[i].start = w.publish(jobs[i].key, in)
		}
	}
	return jobs
}

func (w *crossborderChaos) check(ctx context.Context, pool *pgxpool.Pool, def *saga.Definition, fig *chaosFigures) error {
	res, err := reconcile(ctx, pool, append([]*saga.Definition{def}, def.Children()...), 5*time.Second, 0)
	if err != nil {
		return err
	}
	for _, d := range res.Differences {
		fig.Differences = append(fig.Differences, d.String())
	}
	fig.ByState = res.Crossborder
	fig.Credited, fig.Compensated, fig.Failed = res.Crossborder[string(crossborder.StateCredited)], res.Crossborder["compensated"], res.Crossborder["failed"]
	fig.Sagas = fig.Credited + fig.Compensated + fig.Failed
	var children, converted, compensated, skipped, whole int
	if err := pool.QueryRow(ctx, `select
  count(*) filter (where definition = $1),
  count(*) filter (where definition = $1 and state = 'converted'),
  count(*) filter (where definition = $1 and state = 'compensated'),
  count(*) filter (where definition = $2 and $3 = any(skipped)),
  count(*) filter (where definition = $1 and exists (select 1 from idemsaga.repairs r where r.saga_id = sagas.id and r.operation = 'compensate'))
from idemsaga.sagas`, crossborder.FXName, crossborder.DefinitionName, crossborder.StepFX).Scan(&children, &converted, &compensated, &skipped, &whole); err != nil {
		return err
	}
	var byEvent int
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1 and idem_key like 'chaos-xb-event-%'`, crossborder.DefinitionName).Scan(&byEvent); err != nil {
		return err
	}
	dls, err := w.deadLetters(ctx, pool)
	if err != nil {
		return err
	}
	for _, d := range dls {
		fig.Differences = append(fig.Differences, "an event could not start its transfer: "+d)
	}
	fig.Extra = append(fig.Extra,
		fmt.Sprintf("events             %d transfers started by events; event starts seen by the workers: started %.0f, duplicate %.0f; %d event dead letters",
			byEvent, fig.EventStarts["started"], fig.EventStarts["duplicate"], len(dls)),
		fmt.Sprintf("children           %d FX children: %d converted, %d compensated (%d of them compensated whole when their parent's credit failed); %d transfers in one currency skipped the fx step",
			children, converted, compensated, whole, skipped))
	return nil
}

// deadLetters lists the events that could not start a transfer.
func (w *crossborderChaos) deadLetters(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	cl, err := engine.NewClient(engine.Config{Pool: pool})
	if err != nil {
		return nil, err
	}
	dls, err := cl.EventDeadLetters(ctx, engine.EventDeadLetterFilter{})
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(dls))
	for _, d := range dls {
		out = append(out, fmt.Sprintf("%+v", d))
	}
	return out, nil
}
