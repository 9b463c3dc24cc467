package attempt

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/idemsaga/idemsaga/saga"
)

// context builds the handler's StepContext, its input and results
// opened (Config.Sealer). They are copies: the command's own may become
// the next command's, whatever the handler does to them.
func (a *attempt) context(tx saga.Tx, fwd *stored) (*saga.StepContext, error) {
	c := a.cmd
	sealer := a.r.cfg.Sealer
	input, err := sealer.Open(c.SagaID, c.Input)
	if err != nil {
		return nil, fmt.Errorf("the input of step %q: %w", c.Step, err)
	}
	results, err := sealer.OpenAll(c.SagaID, c.Results)
	if err != nil {
		return nil, err
	}
	results = cloneResults(results)
	sc := &saga.StepContext{
		SagaID: c.SagaID, Definition: c.Definition, Step: c.Step, Phase: c.Phase, Key: c.Key, Attempt: c.Attempt,
		Input: bytes.Clone(input), Results: results, Tx: tx,
	}
	if a.plan.Kind != saga.DatabaseStep {
		sc.Lease = beat{a}
	}
	if c.Phase == saga.PhaseCompensate && fwd != nil {
		sc.ForwardKey = saga.StepKey(c.SagaID, c.Step, saga.PhaseForward)
		if sc.Results == nil {
			sc.Results = map[string]json.RawMessage{}
		}
		if fwd.outcome == "succeeded" {
			if fwd.result != nil || sc.Results[c.Step] == nil {
				r, err := sealer.Open(c.SagaID, fwd.result)
				if err != nil {
					return nil, fmt.Errorf("the forward result of step %q: %w", c.Step, err)
				}
				sc.Results[c.Step] = r
			}
		} else {
			sc.ForwardUnknown = true
			delete(sc.Results, c.Step)
		}
	}
	return sc, nil
}

// invoke runs the handler, turning a panic into a retryable error.
func invoke(ctx context.Context, handler saga.HandlerFunc, sc *saga.StepContext) (result json.RawMessage, err error) {
	defer func() {
		if p := recover(); p != nil {
			result, err = nil, fmt.Errorf("step handler panicked: %v", p)
		}
	}()
	return handler(ctx, sc)
}

// cloneResults copies results, values included.
func cloneResults(results map[string]json.RawMessage) map[string]json.RawMessage {
	if results == nil {
		return nil
	}
	out := make(map[string]json.RawMessage, len(results))
	for k, v := range results {
		out[k] = bytes.Clone(v)
	}
	return out
}
