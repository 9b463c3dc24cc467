package maintenance

import "time"

// meterReading is one reading of a consumer: its deliveries so far (its
// consumer sequence), its messages no worker was given yet, and when.
type meterReading struct {
	delivered, queued uint64
	at                time.Time
}

// busySpan is the time between two readings of a consumer whose queue
// never ran dry meanwhile, and the messages its workers took in it.
type busySpan struct {
	took uint64
	span time.Duration
	end  time.Time
}

// drainMeter measures the pace at which a consumer's workers take its
// messages, from its readings. Only spans in which the queue never ran
// dry count: the queue held more at the span's start than the workers
// took during it. In the others (idle, or workers keeping up) the
// deliveries follow the arrivals and say nothing of what the workers can
// take, so a burst after an idle spell is not judged by the idle pace.
type drainMeter struct {
	last  meterReading
	spans []busySpan
}

// observe adds a reading, taken after the last one.
func (m *drainMeter) observe(r meterReading) {
	prev := m.last
	m.last = r
	switch {
	case prev.at.IsZero() || !r.at.After(prev.at):
	case r.delivered < prev.delivered:
		// The consumer was made again: its sequence started over.
		m.spans = nil
	case prev.queued > 0 && r.delivered-prev.delivered < prev.queued:
		m.spans = append(m.spans, busySpan{took: r.delivered - prev.delivered, span: r.at.Sub(prev.at), end: r.at})
	}
	keep := m.spans[:0]
	for _, s := range m.spans {
		if r.at.Sub(s.end) < drainWindow {
			keep = append(keep, s)
		}
	}
	m.spans = keep
}

// drain predicts the wait of queued messages on consumer at the pace
// measured by the last reading: zero when none are queued or no pace was
// measured over drainMeasuredMin yet.
func (m *drainMeter) drain(consumer string, queued uint64) Drain {
	var took uint64
	var busy time.Duration
	for _, s := range m.spans {
		took += s.took
		busy += s.span
	}
	if queued == 0 || busy < drainMeasuredMin {
		return Drain{}
	}
	d := Drain{Consumer: consumer, Queued: queued, Rate: float64(took) / busy.Seconds(), Measured: busy, Wait: DrainStalled}
	if took > 0 {
		d.Wait = time.Duration(float64(queued) / d.Rate * float64(time.Second))
	}
	return d
}
