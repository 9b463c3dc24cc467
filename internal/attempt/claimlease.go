package attempt

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

// claimLeaseSQL restarts the lease of a dispatched step at its attempt
// ($4) from now ($5 ms) and marks the attempt claimed, so that the reaper
// counts its expiry. Losing it in a crash only leaves the lease running
// from the dispatch: it commits without waiting for the WAL's flush.
const claimLeaseSQL = `update idemsaga.steps set lease_until = idemsaga.now() + $5::bigint * interval '1 millisecond', claimed_attempt = $4
where saga_id = $1 and step = $2 and phase = $3 and attempt = $4 and status = 'dispatched'
  and set_config('synchronous_commit', 'off', true) is not null`

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
	if _, err := r.cfg.Pool.Exec(cctx, claimLeaseSQL, pguuid.Of(cmd.SagaID), cmd.Step, string(cmd.Phase), cmd.Attempt, lease); err != nil {
		r.cfg.Logger.Debug("step worker: could not restart the lease of a command delivered late; its lease runs from its dispatch",
			"saga_id", cmd.SagaID, "step", cmd.Step, "attempt", cmd.Attempt, "error", err)
	}
}
