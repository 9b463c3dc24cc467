// Package metrics holds the engine's Prometheus collectors. Labels are low
// cardinality only: definition, step, phase, outcome, layer; never a saga
// ID or key.
package metrics

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Namespace prefixes every metric name.
const Namespace = "idemsaga"

// Layers at which duplicates are absorbed.
const (
	LayerStart  = "start"
	LayerBroker = "broker"
	LayerInbox  = "inbox"
	// LayerRecent: a step worker remembered answering the same attempt.
	LayerRecent       = "recent"
	LayerOrchestrator = "orchestrator"
	// LayerCallback: a callback step's event delivered again.
	LayerCallback = "callback"
)

// Metrics is the set of collectors one engine updates.
type Metrics struct {
	SagasStarted      *prometheus.CounterVec
	KeyReused         *prometheus.CounterVec
	SagasFinished     *prometheus.CounterVec
	SagaDuration      *prometheus.HistogramVec
	StepAttempts      *prometheus.CounterVec
	StepHandler       *prometheus.HistogramVec
	Duplicates        *prometheus.CounterVec
	StaleReplies      *prometheus.CounterVec
	LeaseTakeovers    *prometheus.CounterVec
	RetriesScheduled  *prometheus.CounterVec
	OutboxPublished   prometheus.Counter
	RelayBatchSeconds prometheus.Histogram
	Deliveries        *prometheus.CounterVec
	UniqueConflicts   *prometheus.CounterVec
	// Callbacks counts callbacks received, by outcome; duplicates
	// (an event delivered again) count under LayerCallback too.
	Callbacks *prometheus.CounterVec
	// ChildEnds counts child sagas' ends applied to their parents' child
	// steps, by phase and outcome.
	ChildEnds            *prometheus.CounterVec
	CallbackWaitsExpired *prometheus.CounterVec
	// DeadlinesPassed and CommandsHeld are the saga deadlines' and the
	// pauses'.
	DeadlinesPassed *prometheus.CounterVec
	CommandsHeld    *prometheus.CounterVec
	// DeadLettersParked and DeadLettersResumed count commands parked in
	// the dead-letter table and sent again from it.
	DeadLettersParked  *prometheus.CounterVec
	DeadLettersResumed *prometheus.CounterVec
	// CommandsHandedBack counts deliveries of commands a worker could not
	// run and handed back to the broker for another.
	CommandsHandedBack *prometheus.CounterVec
	// CommandsRequeued counts expired dispatch timers of commands no
	// worker claimed; StartsShed the starts the API refused under
	// overload.
	CommandsRequeued *prometheus.CounterVec
	StartsShed       *prometheus.CounterVec
	// StateDifferences is what the engine's last reconcile found, by
	// check; ReconcileRuns counts its runs by outcome.
	StateDifferences *prometheus.GaugeVec
	ReconcileRuns    *prometheus.CounterVec
	// Verified counts the answers of steps' Verify, by step and answer
	// (done, not_done, unknown).
	Verified *prometheus.CounterVec
	// LimitWaits counts the turns under a shared limit (saga.Limit) that
	// had to wait, by limit and bound (concurrency, rate, per_key), and
	// LimitWaitSeconds how long a turn waited.
	LimitWaits       *prometheus.CounterVec
	LimitWaitSeconds *prometheus.HistogramVec
	// LeaseExtensions counts the leases an attempt pushed forward, by
	// why: waiting for a limit, or its handler's heartbeat.
	LeaseExtensions *prometheus.CounterVec
	// ScheduleTicks counts a schedule's ticks by outcome (TickStarted,
	// TickDuplicate, TickSkipped, TickRefused); EventStarts the messages
	// of a definition's events by outcome (EventStarted, EventDuplicate,
	// EventRefused).
	ScheduleTicks *prometheus.CounterVec
	EventStarts   *prometheus.CounterVec
}

// Outcomes of ScheduleTicks and EventStarts.
const (
	// TickStarted: the tick's saga was started.
	TickStarted = "started"
	// TickDuplicate: the tick's saga existed already (a pass that lost
	// its commit, or another engine's).
	TickDuplicate = "duplicate"
	// TickSkipped: a missed tick past the catch-up bound, never started.
	TickSkipped = "skipped"
	// TickRefused: the tick's input was refused; the tick is skipped.
	TickRefused = "refused"
	// EventStarted: the message started its saga.
	EventStarted = "started"
	// EventDuplicate: the message's key named a saga already started
	// with the same body (a delivery or a publish again).
	EventDuplicate = "duplicate"
	// EventRefused: the message could not start a saga and went to the
	// event dead letters.
	EventRefused = "refused"
)

// New builds the collectors and registers them with reg. A nil reg keeps
// them unregistered (still safe to update).
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		SagasStarted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "sagas_started_total",
			Help: "Sagas created by Start (duplicates of an existing saga are not counted here).",
		}, []string{"definition"}),
		KeyReused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "idempotency_key_reused_total",
			Help: "Start calls rejected because the key was already used with a different input.",
		}, []string{"definition"}),
		SagasFinished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "sagas_finished_total",
			Help: "Sagas that reached a terminal state, by outcome: completed, compensated, failed (a compensation could not finish) or parked (a step that may have taken effect at another system has no compensation). The last two need a person.",
		}, []string{"definition", "outcome"}),
		SagaDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "saga_duration_seconds",
			Help:    "Time from a saga's creation to its terminal state.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}, []string{"definition", "outcome"}),
		StepAttempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "step_attempts_total",
			Help: "Step attempts run by step workers, by phase and outcome: succeeded, failed, retry, unknown (an external call that may have taken effect), duplicate (answered from the inbox, or a call already in flight).",
		}, []string{"definition", "step", "phase", "outcome"}),
		StepHandler: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "step_handler_seconds",
			Help:    "Time spent in step handlers, transaction included.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"definition", "step", "phase"}),
		Duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "duplicates_absorbed_total",
			Help: "Duplicates absorbed, by layer: start (same key and input), broker (Nats-Msg-Id), recent (a step worker remembered the attempt), inbox (step key), orchestrator (reply already applied), callback (a callback's event id).",
		}, []string{"layer"}),
		StaleReplies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "stale_replies_total",
			Help: "Replies of an older attempt, ignored.",
		}, []string{"definition", "step", "phase"}),
		LeaseTakeovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "lease_takeovers_total",
			Help: "Dispatched steps whose lease expired without a reply and were dispatched again or given up.",
		}, []string{"definition", "step", "phase"}),
		RetriesScheduled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Name: "retries_scheduled_total",
			Help: "Step retries scheduled after a retryable failure.",
		}, []string{"definition", "step", "phase"}),
		OutboxPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: Namespace, Name: "outbox_published_total",
			Help: "Outbox rows published to JetStream and marked.",
		}),
		RelayBatchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: Namespace, Name: "relay_publish_seconds",
			Help:    "Time to publish one relay batch and receive the broker's acks.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
	}
	m.Verified = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "verified_total",
		Help: "Answers of steps' Verify after an attempt whose outcome was unknown, by answer (done, not_done, unknown).",
	}, []string{"definition", "step", "answer"})
	m.LimitWaits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "limit_waits_total",
		Help: "Turns under a shared limit that waited before their attempt started, by limit and bound (concurrency, rate, per_key); a wait spends no attempt.",
	}, []string{"limit", "bound"})
	m.LimitWaitSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "limit_wait_seconds",
		Help:    "How long a turn under a shared limit waited, by limit.",
		Buckets: []float64{0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300},
	}, []string{"limit"})
	m.LeaseExtensions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "lease_extensions_total",
		Help: "Leases an attempt pushed forward while it ran, by reason (limit: waiting for a shared limit; heartbeat: its handler's StepContext.Heartbeat).",
	}, []string{"definition", "step", "reason"})
	m.StateDifferences = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "state_differences",
		Help: "Differences the engine's last reconcile found, by check (failed and parked count sagas that wait for a person; every other check must be 0).",
	}, []string{"check"})
	m.ReconcileRuns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "reconcile_runs_total",
		Help: "Runs of the engine's reconcile, by outcome (ok, error).",
	}, []string{"outcome"})
	m.Deliveries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "deliveries_total",
		Help: "Requests seen by each dedup layer: start calls (start), rows published (broker), commands handled (inbox), replies handled (orchestrator), callbacks received (callback). The hit rate of a layer is duplicates_absorbed_total / deliveries_total.",
	}, []string{"layer"})
	m.UniqueConflicts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "unique_conflicts_total",
		Help: "Inserts that met an existing row on a unique key and were adjudicated by the database, by table (sagas, inbox).",
	}, []string{"table"})
	m.Callbacks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "callbacks_total",
		Help: "Callbacks received for callback steps, by outcome: applied (completed the step), pending (came before the step's request was recorded; applied when it is), late (the step no longer waited: look at the saga), superseded (another event completed the step), duplicate (an event delivered again, answered from its record).",
	}, []string{"definition", "step", "outcome"})
	m.ChildEnds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "child_ends_total",
		Help: "Child sagas' ends applied to the child steps of their parents, by phase and outcome: succeeded (completed; or compensated, for a compensation), failed (compensated on its own: the step failed without effect; or, for a compensation, the child could not finish compensating), possibly_done (the child failed or was closed).",
	}, []string{"definition", "step", "phase", "outcome"})
	m.CallbackWaitsExpired = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "callback_waits_expired_total",
		Help: "Callback steps given up, as possibly done, because no callback came within their wait.",
	}, []string{"definition", "step"})
	m.DeadlinesPassed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "deadlines_passed_total",
		Help: "Sagas cancelled because their definition's deadline passed before they finished.",
	}, []string{"definition"})
	m.CommandsHeld = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "commands_held_total",
		Help: "Step commands not run because their saga or its definition is paused; resuming sends them again at the same attempt.",
	}, []string{"definition", "step", "phase"})
	m.DeadLettersParked = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "dead_letters_parked_total",
		Help: "Commands parked in the dead-letter table after a bounded number of deliveries to workers that did not know their definition, version or step.",
	}, []string{"definition"})
	m.CommandsHandedBack = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "commands_handed_back_total",
		Help: "Deliveries of commands this worker could not run (their definition's version or step is not in its build), handed back to the broker for a worker that runs them.",
	}, []string{"definition"})
	m.DeadLettersResumed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "dead_letters_resumed_total",
		Help: "Parked commands sent again, by how: worker (a worker that runs their version), resend (a person).",
	}, []string{"definition", "how"})
	m.CommandsRequeued = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "commands_requeued_total",
		Help: "Dispatched steps whose command no worker had claimed when its lease ran out: kept at their attempt, by how: queued (still waiting in the stream, nothing sent), resent (not in the stream: sent again), claimed (found running: its lease restarted, the next expiry is a takeover), answered (its outcome in the inbox and no reply applied: applied from the inbox).",
	}, []string{"definition", "step", "phase", "how"})
	m.StartsShed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "starts_shed_total",
		Help: "Saga starts refused (503, nothing written) because the stream's backlog was above the shedding threshold.",
	}, []string{"definition"})
	m.ScheduleTicks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "schedule_ticks_total",
		Help: "Ticks of a definition's schedule, by outcome: started, duplicate (started already), skipped (missed past the catch-up bound), refused (its input refused).",
	}, []string{"definition", "outcome"})
	m.EventStarts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "event_starts_total",
		Help: "Messages of a definition's events, by outcome: started (a saga), duplicate (its saga started already), refused (parked in the event dead letters).",
	}, []string{"definition", "outcome"})
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{
		m.SagasStarted, m.KeyReused, m.SagasFinished, m.SagaDuration,
		m.StepAttempts, m.StepHandler, m.Duplicates, m.StaleReplies,
		m.LeaseTakeovers, m.RetriesScheduled, m.OutboxPublished, m.RelayBatchSeconds,
		m.Deliveries, m.UniqueConflicts, m.Callbacks, m.ChildEnds, m.CallbackWaitsExpired,
		m.DeadlinesPassed, m.CommandsHeld,
		m.DeadLettersParked, m.DeadLettersResumed, m.CommandsHandedBack,
		m.CommandsRequeued, m.StartsShed, m.StateDifferences, m.ReconcileRuns, m.Verified,
		m.LimitWaits, m.LimitWaitSeconds, m.LeaseExtensions,
		m.ScheduleTicks, m.EventStarts,
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("idemsaga: register metrics: %w (give each engine in a process its own Registerer)", err)
		}
	}
	return m, nil
}
