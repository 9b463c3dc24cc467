package maintenance

import (
	"context"
	"time"

	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/outbox"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// backlogCollector reports the outbox backlog when scraped: the rows not
// yet published and the age of the oldest, read from the database (the
// partial index on unpublished rows keeps this cheap).
type backlogCollector struct {
	pool      *pgxpool.Pool
	schema    *pgschema.Schema
	rows, age *prometheus.Desc
}

// NewBacklogCollector reports the outbox backlog of schema.
func NewBacklogCollector(pool *pgxpool.Pool, schema *pgschema.Schema) *backlogCollector {
	return &backlogCollector{
		pool: pool, schema: schema,
		rows: prometheus.NewDesc(metrics.Namespace+"_outbox_backlog_rows", "Outbox rows not yet published.", nil, nil),
		age:  prometheus.NewDesc(metrics.Namespace+"_outbox_oldest_unpublished_seconds", "Age of the oldest unpublished outbox row (0 when none).", nil, nil),
	}
}

func (b *backlogCollector) Describe(ch chan<- *prometheus.Desc) { ch <- b.rows; ch <- b.age }

func (b *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, age, err := outbox.Backlog(ctx, b.pool, b.schema.Name())
	if err != nil {
		ch <- prometheus.NewInvalidMetric(b.rows, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(b.rows, prometheus.GaugeValue, float64(n))
	ch <- prometheus.MustNewConstMetric(b.age, prometheus.GaugeValue, age.Seconds())
}

// byDefinitionCollector reports one gauge by definition when scraped,
// from a query that returns (definition, count) rows.
type byDefinitionCollector struct {
	pool  pgschema.Executor
	query string
	desc  *prometheus.Desc
}

func (b *byDefinitionCollector) Describe(ch chan<- *prometheus.Desc) { ch <- b.desc }

func (b *byDefinitionCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	rows, err := b.pool.Query(ctx, b.query)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(b.desc, err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var def string
		var n int64
		if err := rows.Scan(&def, &n); err != nil {
			ch <- prometheus.NewInvalidMetric(b.desc, err)
			return
		}
		ch <- prometheus.MustNewConstMetric(b.desc, prometheus.GaugeValue, float64(n), def)
	}
	if err := rows.Err(); err != nil {
		ch <- prometheus.NewInvalidMetric(b.desc, err)
	}
}

// streamCollector reports the stream's backlog when scraped: the messages
// in it (commands and replies delivered to no one yet, or not yet
// acknowledged) and the age of the oldest, which the outbox's metrics do
// not see once a row was published; and the part of them no worker was
// given yet (the backlog the reaper and load shedding read).
type streamCollector struct {
	js                   jetstream.JetStream
	name                 string
	backlog              *StreamBacklog
	msgs, ag, qmsgs, qag *prometheus.Desc
}

// NewStreamCollector reports stream name's messages and backlog.
func NewStreamCollector(js jetstream.JetStream, name string, backlog *StreamBacklog) *streamCollector {
	return &streamCollector{js: js, name: name, backlog: backlog,
		msgs:  prometheus.NewDesc(metrics.Namespace+"_stream_messages", "Messages in the engine's JetStream stream: commands and replies not yet acknowledged (a work queue keeps nothing else).", nil, nil),
		ag:    prometheus.NewDesc(metrics.Namespace+"_stream_oldest_message_seconds", "Age of the oldest message in the engine's JetStream stream (0 when empty): compare it with the steps' leases.", nil, nil),
		qmsgs: prometheus.NewDesc(metrics.Namespace+"_stream_queued_messages", "Messages in the engine's stream that no worker was given yet (the backlog load shedding reads).", nil, nil),
		qag:   prometheus.NewDesc(metrics.Namespace+"_stream_oldest_queued_seconds", "Age of the oldest message no worker was given yet (0 when none): starts are shed past the shedding age.", nil, nil),
	}
}

func (s *streamCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.msgs
	ch <- s.ag
	ch <- s.qmsgs
	ch <- s.qag
}

func (s *streamCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name)
	var info *jetstream.StreamInfo
	if err == nil {
		info, err = st.Info(ctx)
	}
	if err != nil {
		// No stream yet, or the broker out of reach (which /readyz says):
		// no sample, rather than a scrape that fails as a whole.
		return
	}
	age := 0.0
	if info.State.Msgs > 0 && !info.State.FirstTime.IsZero() {
		age = max(time.Since(info.State.FirstTime).Seconds(), 0)
	}
	ch <- prometheus.MustNewConstMetric(s.msgs, prometheus.GaugeValue, float64(info.State.Msgs))
	ch <- prometheus.MustNewConstMetric(s.ag, prometheus.GaugeValue, age)
	if b, ok := s.backlog.Get(ctx); ok {
		ch <- prometheus.MustNewConstMetric(s.qmsgs, prometheus.GaugeValue, float64(b.Msgs))
		ch <- prometheus.MustNewConstMetric(s.qag, prometheus.GaugeValue, b.OldestAge(time.Now()).Seconds())
	}
}

// NewPausedCollector reports, when scraped, the running sagas held by a
// pause, by definition.
func NewPausedCollector(pool *pgxpool.Pool, schema *pgschema.Schema) *byDefinitionCollector {
	return &byDefinitionCollector{pool: schema.Q(pool), query: store.CountPaused, desc: prometheus.NewDesc(metrics.Namespace+"_sagas_paused",
		"Running sagas held by a pause, their own or their definition's: no attempt of theirs starts until they are resumed.", []string{"definition"}, nil)}
}

// NewDeadLetterCollector reports, when scraped, how many commands are
// parked, by definition.
func NewDeadLetterCollector(pool *pgxpool.Pool, schema *pgschema.Schema) *byDefinitionCollector {
	return &byDefinitionCollector{pool: schema.Q(pool), query: `select definition, count(*) from idemsaga.dead_letters group by definition`,
		desc: prometheus.NewDesc(metrics.Namespace+"_dead_letters",
			"Commands parked in the dead-letter table, waiting for a worker that runs their definition version or for a person.", []string{"definition"}, nil)}
}
