// Live figures: GET /v1/stats every second, rates over the last seconds.
import {NEEDS_PERSON, every, fmtClock, fmtDuration, fmtNum, fmtPct, h, show, svg, view, viewGet} from './common.js';

const STATS_POLL_MS = 1000;
const RATE_WINDOW_MS = 5000;
const STATS_KEEP = 120;
const OUTCOMES = ['completed', 'compensated', 'failed', 'parked'];
// LAYERS says what each dedup layer counts. seen names the deliveries
// a layer's duplicates are a share of: recent and inbox are two checks
// on the same step commands (a command the worker remembers answering is
// answered without reaching the inbox), so both are a share of the
// commands the inbox layer counts.
const LAYERS = [
  {layer: 'start', seen: 'start', what: 'start requests; a duplicate had the same key and input'},
  {layer: 'broker', seen: 'broker', what: 'outbox rows published; a duplicate was already in the stream (same Nats-Msg-Id)'},
  {layer: 'recent', seen: 'inbox', what: 'step commands; a duplicate was answered from the worker\'s memory of the attempt'},
  {layer: 'inbox', seen: 'inbox', what: 'the same step commands; a duplicate found its step key in the inbox'},
  {layer: 'orchestrator', seen: 'orchestrator', what: 'step replies that came as messages (a database step\'s result is applied with the step, not here); a duplicate had been applied already'},
  {layer: 'callback', seen: 'callback', what: 'callbacks received; a duplicate repeated a recorded event id'},
];

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
      h('p', {class: 'note-box', id: 'live-scope'},
        'These are the counters of the one process that answers this page, since it last started: what this process did and decided. ',
        'Other workers count their own; a restart starts again from 0. ',
        'The Sagas list counts the database (every process, since the first), so the two differ: the list is the record. ',
        'Only the stream and outbox backlogs are the whole deployment\'s.'),
      cards,
      h('h2', null, 'Sagas finished per second'), spark),
    errors,
    h('div', {class: 'cols'},
      h('section', {class: 'card'}, h('h2', null, 'Duplicates absorbed by this process, by layer'),
        h('p', {class: 'muted small'}, 'Seen: what reached the layer in this process. Share: its duplicates over what it saw. ',
          'recent and inbox check the same step commands, one after the other, so their Seen is one count, added once in the last row.'),
        h('table', {class: 'grid', id: 'live-dups'},
          h('thead', null, h('tr', null, ['Layer', 'Seen', 'Duplicates', 'Share of seen', 'Duplicates / s'].map(c => h('th', null, c)))),
          layers)),
      h('section', {class: 'card'}, h('h2', null, 'Finishes decided by this process, by outcome'),
        h('p', {class: 'muted small'}, 'A finish is counted when this process moves a saga to the outcome: a saga that ended failed and finished again after a repair counts once for each. ',
          'The list\'s counts by state are the database\'s.'),
        h('table', {class: 'grid', id: 'live-outcomes-table'},
          h('thead', null, h('tr', null, ['Outcome', 'Finishes', 'Per second'].map(c => h('th', null, c)))),
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

// tile is one figure: its label, value, a line under it, and whose it
// is (this process's counter, or the deployment's backlog).
function tile(id, label, value, sub, cls, scope) {
  return h('div', {class: 'tile ' + (cls || ''), id},
    h('div', {class: 'label'}, label), h('div', {class: 'value'}, value), h('div', {class: 'sub'}, sub || ''),
    h('div', {class: 'scope'}, scope || 'this process, since it started'));
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
  const dupAttempts = (last.step_attempts || {}).duplicate || 0;
  cards.replaceChildren(
    tile('live-finished', 'Sagas finished / s', fmtNum(finishedRate, 1), fmtNum(total(last.sagas_finished)) + ' finishes decided here'),
    tile('live-started', 'Sagas started / s', fmtNum(startedRate, 1), fmtNum(last.sagas_started) + ' created here (duplicates not counted)'),
    tile('live-attempts', 'Step commands / s', fmtNum(attemptsRate, 1), fmtNum(total(last.step_attempts)) + ' handled here, ' + fmtNum(dupAttempts) + ' of them duplicates'),
    tile('live-hit', 'Duplicates absorbed', fmtNum(dupTotal), fmtPct(seenTotal ? dupTotal / seenTotal : null) + ' of the ' + fmtNum(seenTotal) + ' deliveries the layers saw'),
    tile('live-stream', 'Stream backlog', stream === null ? 'unknown' : fmtNum(stream),
      stream === null || age === null ? 'the stream could not be read: look at NATS and the worker\'s log' :
        'queued for no worker yet; oldest ' + fmtDuration(1000 * age) + (held === null ? '' : ' · ' + fmtNum(held) + ' messages kept in the stream'),
      stream === null ? 'warn' : '', 'the deployment, now'),
    tile('live-outbox', 'Outbox backlog', last.outbox_backlog_rows === null ? 'unknown' : fmtNum(last.outbox_backlog_rows),
      last.outbox_oldest_unpublished_seconds === null ? 'the database could not be read: look at the worker\'s log' :
        'rows not yet published; oldest ' + fmtDuration(1000 * last.outbox_oldest_unpublished_seconds),
      last.outbox_backlog_rows === null ? 'warn' : '', 'the deployment, now'),
    tile('live-takeovers', 'Lease takeovers', fmtNum(last.lease_takeovers),
      'steps whose lease ran out without a reply' + (takeoverRate === null ? '' : ' · ' + fmtNum(takeoverRate, 2) + ' / s'),
      last.lease_takeovers > 0 ? 'warn' : ''),
    tile('live-retries', 'Retries scheduled', fmtNum(last.retries_scheduled), 'step attempts that failed and will run again'));
  spark.replaceChildren(sparkline());
  const layerList = LAYERS.slice();
  for (const l of Object.keys(last.deliveries).concat(Object.keys(last.duplicates_absorbed))) {
    if (!layerList.some(x => x.layer === l || x.seen === l)) layerList.push({layer: l, seen: l, what: ''});
  }
  layers.replaceChildren(...layerList.map(({layer, seen: from, what}) => {
    const seen = last.deliveries[from] || 0;
    const dup = last.duplicates_absorbed[layer] || 0;
    const r = rate(s => (s.duplicates_absorbed || {})[layer] || 0);
    return h('tr', {dataset: {layer}},
      h('td', null, layer, what ? h('div', {class: 'small muted'}, what) : null),
      h('td', null, fmtNum(seen), from !== layer ? h('div', {class: 'small muted'}, '= ' + from) : null),
      h('td', null, fmtNum(dup)),
      h('td', null, fmtPct(seen ? dup / seen : null)), h('td', null, fmtNum(r, 2)));
  }), h('tr', {class: 'sum'}, h('td', null, 'all', h('div', {class: 'small muted plain'}, 'each delivery counted once')), h('td', null, fmtNum(seenTotal)), h('td', null, fmtNum(dupTotal)),
    h('td', {id: 'live-hit-rate'}, fmtPct(seenTotal ? dupTotal / seenTotal : null)), h('td', null, fmtNum(rate(s => total(s.duplicates_absorbed)), 2))));
  const names = OUTCOMES.slice();
  for (const o of Object.keys(last.sagas_finished)) if (!names.includes(o)) names.push(o);
  outcomes.replaceChildren(...names.map(o => h('tr', {dataset: {outcome: o}, class: NEEDS_PERSON.has(o) && last.sagas_finished[o] ? 'alarm' : ''},
    h('td', null, o), h('td', null, fmtNum(last.sagas_finished[o] || 0)), h('td', null, fmtNum(rate(s => (s.sagas_finished || {})[o] || 0), 2)))));
  note.textContent = 'Read every ' + STATS_POLL_MS / 1000 + ' s (rates over ' + RATE_WINDOW_MS / 1000 + ' s) · ' + fmtClock(last.at);
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
