package saga

import (
	"fmt"
	"regexp"
	"time"
)

// Limit bounds the calls a step makes to another system, as that system
// bounds them: how many run at once, how many start per period, and how
// many run at once for one key (a tenant, an account). It holds across
// every worker and process that shares the engine's database, not per
// process: a payment provider's quota is per account, whichever worker
// calls.
//
// A call waits for its turn before its attempt starts, with the attempt's
// lease kept alive meanwhile: waiting spends no attempt and no lease, and
// a worker that dies while waiting leaves nothing that looks like an
// unknown outcome. The turn covers the step's forward attempts, its
// compensation's and its Verify's calls. Steps that give the same Name
// share one limit (the charge and the refund of one provider), in every
// definition of the process, and must give it the same bounds.
//
// A limit is for ExternalStep and CallbackStep steps: a DatabaseStep's
// only resource is the engine's own pool.
type Limit struct {
	// Name identifies the limit. Steps that give the same name share it.
	// Defaults to "<definition>.<step>": the step's own. Letters, digits,
	// '_', '-', '.' and ':', at most 128.
	Name string
	// Concurrency, if positive, is the most calls under the limit that
	// run at once.
	Concurrency int
	// Rate, if positive, is the most calls under the limit that start in
	// any period of Per, spaced evenly (Per/Rate apart).
	Rate int
	// Per is Rate's period. Defaults to one second; only with Rate.
	Per time.Duration
	// PerKey, if positive, is the most calls that run at once for one
	// value of KeyFunc: one tenant's share of the limit.
	PerKey int
	// KeyFunc gives the key a call counts against for PerKey, from the
	// attempt's StepContext (a tenant or account in the input). Required
	// with PerKey. An empty key counts against no per-key bound. It must
	// not call other systems.
	KeyFunc func(sc *StepContext) string
}

// IsZero reports whether the limit bounds nothing.
func (l Limit) IsZero() bool {
	return l.Concurrency == 0 && l.Rate == 0 && l.PerKey == 0 && l.KeyFunc == nil && l.Name == "" && l.Per == 0
}

// Spacing is the time between two starts under the limit's rate, 0 when
// it has none.
func (l Limit) Spacing() time.Duration {
	if l.Rate <= 0 {
		return 0
	}
	return l.Per / time.Duration(l.Rate)
}

// String describes the limit's bounds, as an error that compares two
// names them.
func (l Limit) String() string {
	s := l.Name + ":"
	if l.Concurrency > 0 {
		s += fmt.Sprintf(" %d at once", l.Concurrency)
	}
	if l.Rate > 0 {
		s += fmt.Sprintf(" %d per %s", l.Rate, l.Per)
	}
	if l.PerKey > 0 {
		s += fmt.Sprintf(" %d at once per key", l.PerKey)
	}
	return s
}

var limitNamePattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,128}$`)

// withDefaults checks l for a step of kind named step in definition def
// and fills in its defaults. problem is empty when it is valid.
func (l Limit) withDefaults(def, step string, kind StepKind) (Limit, string) {
	if l.IsZero() {
		return l, ""
	}
	switch {
	case kind == DatabaseStep:
		return l, fmt.Sprintf("step %q is a database step; a limit bounds calls to other systems (remove Limit)", step)
	case l.Concurrency < 0 || l.Rate < 0 || l.PerKey < 0 || l.Per < 0:
		return l, "Concurrency, Rate, Per and PerKey must not be negative"
	case l.Per > 0 && l.Rate == 0:
		return l, "Per is Rate's period: give Rate too, or leave Per 0"
	case l.PerKey > 0 && l.KeyFunc == nil:
		return l, "PerKey needs KeyFunc, which says which key (tenant) a call counts against"
	case l.KeyFunc != nil && l.PerKey == 0:
		return l, "KeyFunc is only read with PerKey: give PerKey too, or remove KeyFunc"
	case l.Concurrency == 0 && l.Rate == 0 && l.PerKey == 0:
		return l, "bounds nothing: give Concurrency, Rate or PerKey"
	}
	if l.Name == "" {
		l.Name = def + "." + step
	}
	if !limitNamePattern.MatchString(l.Name) {
		return l, fmt.Sprintf("Name %q must be 1 to 128 letters, digits, '_', '-', '.' or ':'", l.Name)
	}
	if l.Rate > 0 && l.Per == 0 {
		l.Per = time.Second
	}
	if l.Rate > 0 && l.Spacing() < time.Microsecond {
		return l, fmt.Sprintf("Rate %d per %s spaces calls less than a microsecond apart; give a lower rate", l.Rate, l.Per)
	}
	return l, ""
}
