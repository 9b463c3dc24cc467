package order_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/saga"
)

// heldCharge is a transport that holds the first charge request on its
// way: the attempt times out (its outcome unknown), the charge's Verify
// asks the service and hears 404, and only then does the held request
// reach the service and charge, as the chaos run's LateCommit does.
type heldCharge struct {
	n        atomic.Int32
	arrived  chan struct{} // the first charge request is held
	verified chan struct{} // a Verify heard 404 for the key
	sent     chan struct{} // the held request reached the service
	status   atomic.Int32  // what the service answered it
	vonce    sync.Once
}

func newHeldCharge() *heldCharge {
	return &heldCharge{arrived: make(chan struct{}), verified: make(chan struct{}), sent: make(chan struct{})}
}

func (h *heldCharge) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodPost && req.URL.Path == "/charges" && h.n.Add(1) == 1 {
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return nil, err
		}
		late := req.Clone(context.Background())
		late.Body, late.ContentLength, late.GetBody = io.NopCloser(bytes.NewReader(body)), int64(len(body)), nil
		close(h.arrived)
		go func() {
			defer close(h.sent)
			select {
			case <-h.verified:
			case <-time.After(20 * time.Second):
			}
			resp, err := http.DefaultTransport.RoundTrip(late)
			if err == nil {
				h.status.Store(int32(resp.StatusCode))
				_ = resp.Body.Close()
			}
		}()
		<-req.Context().Done()
		return nil, req.Context().Err()
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err == nil && req.Method == http.MethodGet && strings.HasPrefix(req.URL.Path, "/charges/") && resp.StatusCode == http.StatusNotFound {
		h.vonce.Do(func() { close(h.verified) })
	}
	return resp, err
}

// TestBranchVerifiedNotDoneIsVoided: an out-of-stock order (its reserve
// fails for good) while the charge beside it, in the same parallel
// group, is between attempts: its first attempt timed out and its Verify
// heard "no charge under this key", but the request is still on its way.
// The group is given up; the charge branch is settled as verified not
// done, and its refund must still run, to void the key against the
// request on its way. Without it the late charge takes the money from a
// compensated order.
func TestBranchVerifiedNotDoneIsVoided(t *testing.T) {
	t.Parallel()
	held := newHeldCharge()
	v := start(t, nil, func(cfg order.Config) (*saga.Definition, error) {
		cfg.Transport = held
		// The charge's next attempt comes late, so that the reservation's
		// failure is applied while the charge is between attempts.
		cfg.Policy = saga.RetryPolicy{MaxAttempts: 3, InitialBackoff: 3 * time.Second, MaxBackoff: 3 * time.Second, Timeout: 500 * time.Millisecond}
		cfg.CompensatePolicy = policy
		d, err := order.NewDefinition(cfg)
		if err != nil {
			return nil, err
		}
		steps := d.Steps()
		reserve := steps[0].Forward
		// The reservation waits for the charge to be on its way: its own
		// timeout is not the charge's short one.
		steps[0].Retry.Timeout = 30 * time.Second
		// The reservation fails once the charge request is on its way.
		steps[0].Forward = func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			select {
			case <-held.arrived:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return reserve(ctx, sc)
		}
		d2, err := saga.New(order.DefinitionName, steps...)
		if err != nil {
			return nil, err
		}
		return saga.WithInput(d2, order.Input.Validate), nil
	})
	v.dropConfirmations.Store(true)
	in := ann("1 Main St")
	in.Quantity = 1000 // out of stock: reserve fails for good
	sg := v.run("out-of-stock", in)
	require.Equal(t, saga.StateCompensated, sg.State, sg.Error)
	require.Contains(t, sg.Error, "out of stock")
	select {
	case <-held.sent:
	case <-time.After(30 * time.Second):
		t.Fatal("the held charge was never sent")
	}
	require.Equal(t, saga.StepFailed, v.step(sg, order.StepCharge, saga.PhaseForward).Status)
	require.Equal(t, saga.StepSucceeded, v.step(sg, order.StepCharge, saga.PhaseCompensate).Status, "the refund ran")
	state, _ := v.charge(sg.ID)
	require.Contains(t, []string{"refunded", "voided"}, state, "the charge of a compensated order is given back, or its key voided before it came")
	v.audit(map[string]int{"compensated": 1})
}
