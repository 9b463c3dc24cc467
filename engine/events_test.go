package engine_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// orderEvent is the input of the sagas the events start.
type orderEvent struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

func (o orderEvent) validate() error {
	if o.Amount <= 0 {
		return errors.New("amount must be positive")
	}
	return nil
}

// eventDef is a one-step definition started by the events of subject.
func eventDef(name string, e saga.Events) *saga.Definition {
	d := saga.MustNew(name, saga.Step{
		Name: "take", Reaches: "taken", Kind: saga.DatabaseStep, Retry: fastPolicy,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil },
	})
	return saga.WithEvents(saga.WithInput(d, orderEvent.validate), e)
}

// shopStream creates the publisher's stream, which captures shop.>.
func shopStream(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "SHOP", Subjects: []string{"shop.>"}})
	require.NoError(t, err)
	return js
}

func publish(t testing.TB, js jetstream.JetStream, subject string, headers map[string]string, body string) {
	t.Helper()
	msg := nats.NewMsg(subject)
	for k, v := range headers {
		msg.Header.Set(k, v)
	}
	msg.Data = []byte(body)
	_, err := js.PublishMsg(context.Background(), msg)
	require.NoError(t, err)
}

// waitMetric waits up to 30 s for a counter's sum to reach want.
func waitMetric(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string, want float64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := metricSum(t, reg, name, labels)
		if got >= want {
			require.Equal(t, want, got)
			return
		}
		require.False(t, time.Now().After(deadline), "%s%v is %v after 30 s, want %v", name, labels, got, want)
		time.Sleep(5 * time.Millisecond)
	}
}

func eventEngine(reg *prometheus.Registry) engineOpt {
	return func(c *engine.Config) {
		c.Registerer = reg
		c.ReconcileInterval = engine.NoReconcile
	}
}

// One event delivered ten times starts one saga: published ten times
// under one key (the broker's dedup stops the copies of one Nats-Msg-Id;
// a key header of the user's lets every copy through), and delivered
// again from the start of the stream.
func TestEventDeliveredTenTimesStartsOneSaga(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	js := shopStream(t, nc)
	byMsgID := eventDef("order_msgid", saga.Events{Subject: "shop.orders.created"})
	byHeader := eventDef("order_header", saga.Events{Subject: "shop.orders.placed", KeyHeader: "Order-Id"})
	defs := []*saga.Definition{byMsgID, byHeader}
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, "EVT10", defs, eventEngine(reg))

	for range 10 {
		publish(t, js, "shop.orders.created", map[string]string{jetstream.MsgIDHeader: "o-1"}, `{"order_id":"o-1","amount":5}`)
		publish(t, js, "shop.orders.placed", map[string]string{"Order-Id": "o-2"}, `{"order_id":"o-2","amount":7}`)
	}
	header := map[string]string{"definition": "order_header"}
	waitMetric(t, reg, "idemsaga_event_starts_total", header, 10)
	waitSagaByKey(t, pool, "order_msgid", "o-1")
	require.Equal(t, 1.0, metricSum(t, reg, "idemsaga_event_starts_total", map[string]string{"definition": "order_header", "outcome": "started"}))
	require.Equal(t, 9.0, metricSum(t, reg, "idemsaga_event_starts_total", map[string]string{"definition": "order_header", "outcome": "duplicate"}))

	// Delivered again: the consumer is gone (an operator deleted it, a
	// broker lost it); the engine makes it again at the stream's start,
	// and every message comes again.
	require.NoError(t, e.Stop(context.Background()))
	for _, name := range []string{"EVT10_events_order_msgid", "EVT10_events_order_header"} {
		require.NoError(t, js.DeleteConsumer(context.Background(), "SHOP", name))
	}
	reg2 := prometheus.NewRegistry()
	e = startEngine(t, pool, nc, "EVT10", defs, eventEngine(reg2))
	waitMetric(t, reg2, "idemsaga_event_starts_total", header, 10)
	waitMetric(t, reg2, "idemsaga_event_starts_total", map[string]string{"definition": "order_msgid"}, 1)
	require.Equal(t, 10.0, metricSum(t, reg2, "idemsaga_event_starts_total", map[string]string{"definition": "order_header", "outcome": "duplicate"}))
	require.Equal(t, 1.0, metricSum(t, reg2, "idemsaga_event_starts_total", map[string]string{"definition": "order_msgid", "outcome": "duplicate"}))

	for _, def := range defs {
		ids := sagaIDs(t, pool, def.Name())
		require.Len(t, ids, 1, "one saga for %s", def.Name())
		sg := waitState(t, e.Client(), ids[0], "taken")
		var in orderEvent
		require.NoError(t, json.Unmarshal(sg.Input, &in))
		require.Equal(t, sg.Key, in.OrderID)
	}
	dls, err := e.Client().EventDeadLetters(context.Background(), engine.EventDeadLetterFilter{})
	require.NoError(t, err)
	require.Empty(t, dls)
}

// A message that cannot start a saga is parked with its reason and
// acknowledged: a body the input rules refuse, a message without its
// key, a key that names a saga of another body.
func TestEventRefusedGoesToDeadLetters(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	js := shopStream(t, nc)
	def := eventDef("order_bad", saga.Events{Subject: "shop.orders.bad", KeyHeader: "Order-Id"})
	reg := prometheus.NewRegistry()
	e := startEngine(t, pool, nc, "EVTBAD", []*saga.Definition{def}, eventEngine(reg))

	publish(t, js, "shop.orders.bad", map[string]string{"Order-Id": "b-1"}, `{"order_id":"b-1","amount":-3}`)
	publish(t, js, "shop.orders.bad", map[string]string{"Order-Id": "b-2"}, `{"order_id":"b-2","amount":3,"Amount":4}`)
	publish(t, js, "shop.orders.bad", nil, `{"order_id":"b-3","amount":3}`)
	publish(t, js, "shop.orders.bad", map[string]string{"Order-Id": "b-4"}, `{"order_id":"b-4","amount":4}`)
	publish(t, js, "shop.orders.bad", map[string]string{"Order-Id": "b-4"}, `{"order_id":"b-4","amount":40}`)
	waitMetric(t, reg, "idemsaga_event_starts_total", map[string]string{"definition": "order_bad"}, 5)
	require.Equal(t, 4.0, metricSum(t, reg, "idemsaga_event_starts_total", map[string]string{"definition": "order_bad", "outcome": "refused"}))

	dls, err := e.Client().EventDeadLetters(context.Background(), engine.EventDeadLetterFilter{Definition: "order_bad"})
	require.NoError(t, err)
	require.Len(t, dls, 4)
	// Handled concurrently: in the stream's order for the checks.
	slices.SortFunc(dls, func(a, b engine.EventDeadLetter) int { return cmp.Compare(a.StreamSeq, b.StreamSeq) })
	require.Equal(t, "b-1", dls[0].Key)
	require.Contains(t, dls[0].Reason, "amount must be positive")
	require.Equal(t, `{"order_id":"b-1","amount":-3}`, string(dls[0].Body))
	require.Contains(t, dls[1].Reason, "Amount")
	require.Empty(t, dls[2].Key)
	require.Contains(t, dls[2].Reason, "no Order-Id header")
	require.Equal(t, "b-4", dls[3].Key)
	require.Contains(t, dls[3].Reason, "already used")
	for i, d := range dls[:3] {
		require.Equal(t, "SHOP", d.Stream)
		require.Equal(t, "shop.orders.bad", d.Subject)
		require.Equal(t, uint64(i+1), d.StreamSeq)
	}
	// The two b-4 messages are handled at once: the first to commit
	// starts the saga, the other is refused, whichever came first.
	require.Equal(t, []string{"b-4"}, sagaKeys(t, pool, "order_bad"))
	sg, err := e.Client().GetByKey(context.Background(), "order_bad", "b-4")
	require.NoError(t, err)
	var in orderEvent
	require.NoError(t, json.Unmarshal(sg.Input, &in))
	refused := map[int]uint64{4: 5, 40: 4}[in.Amount]
	require.NotZero(t, refused, "the saga has one of the two bodies, not %d", in.Amount)
	require.Equal(t, refused, dls[3].StreamSeq)

	// Every message was acknowledged (acks travel apart from the
	// handling): none waits for a delivery again.
	c, err := js.Consumer(context.Background(), "SHOP", "EVTBAD_events_order_bad")
	require.NoError(t, err)
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err := c.Info(context.Background())
		require.NoError(t, err)
		if info.AckFloor.Stream == 5 {
			require.Zero(t, info.NumAckPending)
			require.Zero(t, info.NumPending)
			require.Zero(t, info.NumRedelivered, "no message was delivered twice")
			break
		}
		require.False(t, time.Now().After(deadline), "ack floor %d after 30 s, want 5", info.AckFloor.Stream)
		time.Sleep(5 * time.Millisecond)
	}

	require.NoError(t, e.Client().DropEventDeadLetters(context.Background(), dls[0].ID, dls[1].ID))
	require.ErrorIs(t, e.Client().DropEventDeadLetters(context.Background(), dls[0].ID), engine.ErrDeadLetterNotFound)
	dls, err = e.Client().EventDeadLetters(context.Background(), engine.EventDeadLetterFilter{})
	require.NoError(t, err)
	require.Len(t, dls, 2)
}

// An engine whose events no stream holds does not start, and says what
// to create.
func TestEventsWithoutStreamFailAtStart(t *testing.T) {
	t.Parallel()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	def := eventDef("order_nostream", saga.Events{Subject: "nowhere.orders"})
	cfg := engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}, Stream: "EVTNO", SubjectPrefix: "t.EVTNO", Logger: quietLogger()}
	e, err := engine.New(cfg)
	require.NoError(t, err)
	require.NoError(t, engine.Deploy(context.Background(), cfg))
	err = e.Start(context.Background())
	require.ErrorContains(t, err, `no JetStream stream captures subject "nowhere.orders"`)
	require.ErrorContains(t, err, "nats stream add")

	_, err = engine.New(engine.Config{Pool: pool, NATS: nc, Stream: "EVTNO", SubjectPrefix: "t.EVTNO",
		Definitions: []*saga.Definition{eventDef("order_own", saga.Events{Subject: "t.commands"})}})
	require.ErrorContains(t, err, "the engine's own messages")
}
