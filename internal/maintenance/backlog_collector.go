package maintenance

import (
	"context"
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/internal/metrics"
)

// drainCollector reports, when scraped, the wait the stream's queues
// predict at the workers' measured pace (Backlog.Drain): what load
// shedding compares with its bound.
type drainCollector struct {
	backlog    *StreamBacklog
	wait, rate *prometheus.Desc
}

// NewDrainCollector reports backlog's predicted drain.
func NewDrainCollector(backlog *StreamBacklog) prometheus.Collector {
	return &drainCollector{backlog: backlog,
		wait: prometheus.NewDesc(metrics.Namespace+"_stream_drain_seconds",
			"Time the messages no worker was given yet take to reach one at the pace the workers took them over the last 10 s in which their queue never ran dry: the longest over the engine's consumers, +Inf when the workers took none, 0 when nothing waits or no pace was measured yet. Starts are shed while it is above the shedding age.", nil, nil),
		rate: prometheus.NewDesc(metrics.Namespace+"_stream_drain_rate",
			"Messages a second the workers took from the queue of idemsaga_stream_drain_seconds (absent while it is 0).", nil, nil),
	}
}

func (d *drainCollector) Describe(ch chan<- *prometheus.Desc) { ch <- d.wait; ch <- d.rate }

func (d *drainCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	b, ok := d.backlog.Get(ctx)
	if !ok {
		return
	}
	wait := b.Drain.Wait.Seconds()
	if b.Drain.Wait == DrainStalled {
		wait = math.Inf(1)
	}
	ch <- prometheus.MustNewConstMetric(d.wait, prometheus.GaugeValue, wait)
	if b.Drain.Measured > 0 {
		ch <- prometheus.MustNewConstMetric(d.rate, prometheus.GaugeValue, b.Drain.Rate)
	}
}
