// Live figures: GET /v1/stats every second, rates over the last seconds.
import {NEEDS_PERSON, every, fmtDuration, fmtNum, fmtPct, h, show, svg, view, viewGet} from './common.js';

const STATS_POLL_MS = 1000;
const RATE_WINDOW_MS = 5000;
const STATS_KEEP = 120;
const OUTCOMES = ['completed', 'compensated', 'failed', 'parked'];
const LAYERS = ['start', 'broker', 'recent', 'inbox', 'orchestrator', 'callback'];

const samples = []; // GET /v1/stats answers, oldest first, across views

// forgetSamples drops what was read, on signing out.
export function forgetSamples() { samples.length = 0; }

// liveView polls GET /v1/stats and draws the figures.
export function liveView() {
  const seq = view.seq;
  const errors = h('div', {id: 'live-error'});
  const cards = h('div', {class: 'tiles', id: 'live-tiles'});
  const spark = h('div', {class: 'spark', id: 'live-spark'});
  const layers = h('tbody', {id: 'live-layers'});
  const outcomes = h('tbody', {id: 'live-outcomes'});
  const note = h('p', {class: 'muted small', id: 'live-note'});
  show(
    h('section', {class: 'card'},
      h('div', {class: 'row'}, h('h1', null, 'Live figures'), note),
      cards,
      h('h2', null, 'Sagas finished per second'), spark),
    errors,
    h('div', {class: 'cols'},
      h('section', {class: 'card'}, h('h2', null, 'Duplicates absorbed, by layer'),
        h('table', {class: 'grid', id: 'live-dups'},
          h('thead', null, h('tr', null, ['Layer', 'Seen', 'Duplicates', 'Hit rate', 'Duplicates / s'].map(c => h('th', null, c)))),
          layers)),
      h('section', {class: 'card'}, h('h2', null, 'Sagas finished, by outcome'),
        h('table', {class: 'grid'},
          h('thead', null, h('tr', null, ['Outcome', 'Total', 'Per second'].map(c => h('th', null, c)))),
          outcomes))));

  const poll = async () => {
    const data = await viewGet('v1/stats', seq, errors);
    if (data === null) return;
    addSample(data);
    renderLive({cards, spark, layers, outcomes, note});
  };
  if (samples.length) renderLive({cards, spark, layers, outcomes, note});
  poll();
  every(STATS_POLL_MS, poll);
}

function addSample(s) {
  s.t = new Date(s.at).getTime();
  const prev = samples[samples.length - 1];
  // Counters that went back mean another process answered, or it
  // restarted: rates restart from here.
  if (prev && (s.t <= prev.t || total(s.sagas_finished) < total(prev.sagas_finished) || s.sagas_started < prev.sagas_started)) samples.length = 0;
  samples.push(s);
  if (samples.length > STATS_KEEP) samples.shift();
}

function total(m) { let n = 0; for (const v of Object.values(m || {})) n += v; return n; }

// rate is the change per second of f over the last RATE_WINDOW_MS, null
// before two samples.
function rate(f) {
  if (samples.length < 2) return null;
  const last = samples[samples.length - 1];
  let first = samples[0];
  for (let i = samples.length - 2; i >= 0; i--) {
    first = samples[i];
    if (last.t - samples[i].t >= RATE_WINDOW_MS) break;
  }
  const dt = (last.t - first.t) / 1000;
  return dt > 0 ? (f(last) - f(first)) / dt : null;
}

function tile(id, label, value, sub, cls) {
  return h('div', {class: 'tile ' + (cls || ''), id},
    h('div', {class: 'label'}, label), h('div', {class: 'value'}, value), h('div', {class: 'sub'}, sub || ''));
}

function renderLive({cards, spark, layers, outcomes, note}) {
  const last = samples[samples.length - 1];
  const finishedRate = rate(s => total(s.sagas_finished));
  const startedRate = rate(s => s.sagas_started);
  const takeoverRate = rate(s => s.lease_takeovers);
  const attemptsRate = rate(s => total(s.step_attempts));
  const dupTotal = total(last.duplicates_absorbed);
  const seenTotal = total(last.deliveries);
  const stream = last.stream_queued_messages;
  const age = last.stream_oldest_queued_seconds;
  const held = last.stream_messages;
  cards.replaceChildren(
    tile('live-finished', 'Sagas finished / s', fmtNum(finishedRate, 1), fmtNum(total(last.sagas_finished)) + ' in all'),
    tile('live-started', 'Sagas started / s', fmtNum(startedRate, 1), fmtNum(last.sagas_started) + ' in all'),
    tile('live-attempts', 'Step attempts / s', fmtNum(attemptsRate, 1), fmtNum(total(last.step_attempts)) + ' in all'),
    tile('live-hit', 'Duplicates absorbed', fmtNum(dupTotal), 'hit rate ' + fmtPct(seenTotal ? dupTotal / seenTotal : null) + ' of ' + fmtNum(seenTotal) + ' seen'),
    tile('live-stream', 'Stream backlog', stream === null ? 'unknown' : fmtNum(stream),
      age === null ? 'the stream could not be read' : 'oldest ' + fmtDuration(1000 * age) + (held === null ? '' : ' · ' + fmtNum(held) + ' in the stream'),
      stream === null ? 'warn' : ''),
    tile('live-outbox', 'Outbox backlog', last.outbox_backlog_rows === null ? 'unknown' : fmtNum(last.outbox_backlog_rows),
      last.outbox_oldest_unpublished_seconds === null ? '' : 'oldest ' + fmtDuration(1000 * last.outbox_oldest_unpublished_seconds)),
    tile('live-takeovers', 'Lease takeovers', fmtNum(last.lease_takeovers), takeoverRate === null ? '' : fmtNum(takeoverRate, 2) + ' / s',
      last.lease_takeovers > 0 ? 'warn' : ''),
    tile('live-retries', 'Retries scheduled', fmtNum(last.retries_scheduled), ''));
  spark.replaceChildren(sparkline());
  const layerNames = LAYERS.slice();
  for (const l of Object.keys(last.deliveries).concat(Object.keys(last.duplicates_absorbed))) if (!layerNames.includes(l)) layerNames.push(l);
  layers.replaceChildren(...layerNames.map(l => {
    const seen = last.deliveries[l] || 0;
    const dup = last.duplicates_absorbed[l] || 0;
    const r = rate(s => (s.duplicates_absorbed || {})[l] || 0);
    return h('tr', {dataset: {layer: l}}, h('td', null, l), h('td', null, fmtNum(seen)), h('td', null, fmtNum(dup)),
      h('td', null, fmtPct(seen ? dup / seen : null)), h('td', null, fmtNum(r, 2)));
  }), h('tr', {class: 'sum'}, h('td', null, 'all'), h('td', null, fmtNum(seenTotal)), h('td', null, fmtNum(dupTotal)),
    h('td', {id: 'live-hit-rate'}, fmtPct(seenTotal ? dupTotal / seenTotal : null)), h('td', null, fmtNum(rate(s => total(s.duplicates_absorbed)), 2))));
  const names = OUTCOMES.slice();
  for (const o of Object.keys(last.sagas_finished)) if (!names.includes(o)) names.push(o);
  outcomes.replaceChildren(...names.map(o => h('tr', {dataset: {outcome: o}, class: NEEDS_PERSON.has(o) && last.sagas_finished[o] ? 'alarm' : ''},
    h('td', null, o), h('td', null, fmtNum(last.sagas_finished[o] || 0)), h('td', null, fmtNum(rate(s => (s.sagas_finished || {})[o] || 0), 2)))));
  note.textContent = 'Counters of the worker serving this page, read every ' + STATS_POLL_MS / 1000 + ' s (rates over ' + RATE_WINDOW_MS / 1000 + ' s) · ' + new Date(last.at).toLocaleTimeString();
}

// sparkline plots sagas finished per second between successive samples.
function sparkline() {
  const W = 1000, H = 80;
  const el = svg('svg', {viewBox: `0 0 ${W} ${H}`, width: '100%', height: H, preserveAspectRatio: 'none', role: 'img', 'aria-label': 'sagas finished per second'});
  const pts = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = (samples[i].t - samples[i - 1].t) / 1000;
    if (dt > 0) pts.push({t: samples[i].t, v: (total(samples[i].sagas_finished) - total(samples[i - 1].sagas_finished)) / dt});
  }
  if (pts.length < 2) return h('div', {class: 'spark-empty'}, 'collecting samples…');
  const max = Math.max(1, ...pts.map(p => p.v));
  const t0 = pts[0].t, span = Math.max(1, pts[pts.length - 1].t - t0);
  const xy = p => [(W - 4) * (p.t - t0) / span + 2, H - 4 - (H - 12) * p.v / max];
  const d = pts.map((p, i) => (i ? 'L' : 'M') + xy(p).map(n => n.toFixed(1)).join(' ')).join(' ');
  const [x0] = xy(pts[0]), [x1] = xy(pts[pts.length - 1]);
  el.append(svg('path', {d: d + ` L${x1.toFixed(1)} ${H - 4} L${x0.toFixed(1)} ${H - 4} Z`, class: 'spark-area'}));
  el.append(svg('path', {d, class: 'spark-line', 'vector-effect': 'non-scaling-stroke'}));
  const secs = Math.round(span / 1000);
  return h('div', {class: 'spark-box'}, el,
    h('div', {class: 'spark-axis'}, h('span', null, secs + ' s ago'), h('span', null, 'peak ' + max.toFixed(1) + ' / s'), h('span', null, 'now')));
}
