package attempt

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// late reports whether a delivery should restart its step's lease: the
// command waited in the stream past half the lease grace, which the lease
// set at dispatch may not cover with the step's timeout, or it is
// delivered again (an earlier delivery ended without an ack: a crash, a
// lost ack). A prompt first delivery is left alone: its lease, set at
// dispatch, still holds the step's timeout, and an attempt that runs holds
// its key's lock, which the reaper sees.
func (r *Runner) late(md *jetstream.MsgMetadata) bool {
	if r.cfg.LeaseGrace <= 0 {
		return false
	}
	return md.NumDelivered > 1 || time.Since(md.Timestamp) > r.cfg.LeaseGrace/2
}

// claimLease restarts cmd's lease at its delivery. A failure leaves the
// lease as it was, which the reaper then reads as before.
func (r *Runner) claimLease(ctx context.Context, cmd wire.Command) {
	def, idx, err := r.lookup(cmd)
	if err != nil {
		return
	}
	policy := def.Step(idx).Retry
	if cmd.Phase == saga.PhaseCompensate {
		policy = def.Step(idx).CompensateRetry
	}
	lease := (policy.Timeout + r.cfg.LeaseGrace).Milliseconds()
	cctx, cancel := context.WithTimeout(ctx, policy.Timeout)
	defer cancel()
	if _, err := r.db().Exec(cctx, store.ClaimLease, pguuid.Of(cmd.SagaID), cmd.Step, string(cmd.Phase), cmd.Attempt, lease); err != nil {
		r.cfg.Logger.Debug("step worker: could not restart the lease of a command delivered late; its lease runs from its dispatch",
			"saga_id", cmd.SagaID, "step", cmd.Step, "attempt", cmd.Attempt, "error", err)
	}
}
