package saga

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// Defaults of a RetryPolicy's zero fields.
const (
	MaxAttemptsDefault    = 5
	InitialBackoffDefault = 100 * time.Millisecond
	MaxBackoffDefault     = 30 * time.Second
	MultiplierDefault     = 2.0
	JitterDefault         = 0.2
	TimeoutDefault        = 30 * time.Second
)

// RetryPolicy says how often and how fast a step is retried. Zero fields take
// the defaults above. Every error is retried unless marked with Permanent.
type RetryPolicy struct {
	// MaxAttempts is the number of attempts, the first one included.
	// Defaults to MaxAttemptsDefault.
	MaxAttempts int
	// InitialBackoff is the delay before the second attempt. Defaults to
	// InitialBackoffDefault.
	InitialBackoff time.Duration
	// MaxBackoff caps the delay between attempts. Defaults to
	// MaxBackoffDefault.
	MaxBackoff time.Duration
	// Multiplier grows the delay after each attempt. Defaults to
	// MultiplierDefault.
	Multiplier float64
	// Jitter is the fraction of the delay drawn at random, in [0, 1], so
	// that many sagas failing together do not retry together. Defaults to
	// JitterDefault. Use a negative value for no jitter.
	Jitter float64
	// Timeout bounds one attempt of the handler. It also sets the step's
	// lease: a dispatched attempt with no reply after Timeout plus the
	// engine's lease grace is dispatched again. Defaults to TimeoutDefault.
	Timeout time.Duration
}

// WithDefaults returns p with its zero fields set to the defaults.
func (p RetryPolicy) WithDefaults() RetryPolicy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = MaxAttemptsDefault
	}
	if p.InitialBackoff == 0 {
		p.InitialBackoff = InitialBackoffDefault
	}
	if p.MaxBackoff == 0 {
		p.MaxBackoff = MaxBackoffDefault
	}
	if p.Multiplier == 0 {
		p.Multiplier = MultiplierDefault
	}
	if p.Jitter == 0 {
		p.Jitter = JitterDefault
	}
	// A negative Jitter stays negative, so that applying the defaults
	// again does not turn "no jitter" into the default.
	if p.Timeout == 0 {
		p.Timeout = TimeoutDefault
	}
	return p
}

func (p RetryPolicy) validate() error {
	switch {
	case p.MaxAttempts < 0:
		return fmt.Errorf("MaxAttempts is %d; use 1 or more, or 0 for the default", p.MaxAttempts)
	case p.InitialBackoff < 0:
		return fmt.Errorf("InitialBackoff is negative (%s)", p.InitialBackoff)
	case p.MaxBackoff < 0:
		return fmt.Errorf("MaxBackoff is negative (%s)", p.MaxBackoff)
	case p.MaxBackoff != 0 && p.InitialBackoff > p.MaxBackoff:
		return fmt.Errorf("InitialBackoff %s exceeds MaxBackoff %s", p.InitialBackoff, p.MaxBackoff)
	case p.MaxBackoff == 0 && p.InitialBackoff > MaxBackoffDefault:
		return fmt.Errorf("InitialBackoff %s exceeds the default MaxBackoff %s; set MaxBackoff too", p.InitialBackoff, MaxBackoffDefault)
	case p.Multiplier != 0 && p.Multiplier < 1:
		return fmt.Errorf("field Multiplier is %g; use 1 or more", p.Multiplier)
	case p.Jitter > 1:
		return fmt.Errorf("field Jitter is %g; use a fraction between 0 and 1", p.Jitter)
	case p.Timeout < 0:
		return fmt.Errorf("field Timeout is negative (%s)", p.Timeout)
	}
	return nil
}

// Backoff returns the delay before the attempt that follows attempt
// (attempt counts from 1): InitialBackoff × Multiplier^(attempt-1), capped at
// MaxBackoff, with up to Jitter of it drawn at random below that value.
// Defaults apply to zero fields.
func (p RetryPolicy) Backoff(attempt int) time.Duration {
	p = p.WithDefaults()
	if attempt < 1 {
		attempt = 1
	}
	base := p.MaxBackoff
	if d := float64(p.InitialBackoff) * math.Pow(p.Multiplier, float64(attempt-1)); d < float64(p.MaxBackoff) {
		base = time.Duration(d)
	}
	if p.Jitter <= 0 {
		return base
	}
	// Computed in float64, then clamped, so that a base near the largest
	// Duration cannot overflow into a negative delay.
	cut := float64(base) * p.Jitter * rand.Float64()
	if cut >= float64(base) {
		return 0
	}
	return base - time.Duration(cut)
}
