// The idemsaga console: a single page over the HTTP API (/v1) of the
// worker that serves it. Every figure and saga shown is read from /v1 with
// the bearer token the operator gave (kept in this tab's sessionStorage);
// data is always inserted as text, never as markup.
'use strict';

const TOKEN_KEY = 'idemsaga.console.token';
// The API lives beside /ui/ on the same origin, under whatever prefix a
// proxy put in front of both.
const BASE = location.pathname.replace(/ui\/[^/]*$/, '');
const LIST_REFRESH_MS = 5000;
const SAGA_REFRESH_MS = 1000;
const STATS_POLL_MS = 1000;
const RATE_WINDOW_MS = 5000;
const STATS_KEEP = 120;
const OUTCOMES = ['completed', 'compensated', 'failed', 'parked'];
const LAYERS = ['start', 'broker', 'recent', 'inbox', 'orchestrator', 'callback'];
const NEEDS_PERSON = new Set(['failed', 'parked']);

const session = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  // authRequired is learnt from the server's first answer.
  authRequired: false,
  definitions: [],
};

// Timers of the current view, cleared when the view changes.
let viewTimers = [];
let viewSeq = 0;
const samples = []; // GET /v1/stats answers, oldest first, across views

// ---- DOM helpers -------------------------------------------------------

// h builds an element: h('td', {class: 'x'}, 'text', child…). Strings
// become text nodes; attributes starting with "on" are listeners.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

function svg(tag, attrs) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

function main() { return document.getElementById('main'); }

function show(...children) {
  const m = main();
  m.replaceChildren();
  append(m, children);
}

function fmtTime(s) {
  if (!s) return '—';
  const d = new Date(s);
  if (isNaN(d)) return s;
  return d.toISOString().replace('T', ' ').replace(/\.(\d{3})\d*Z$/, '.$1Z');
}

function fmtAgo(s) {
  if (!s) return '';
  const ms = Date.now() - new Date(s).getTime();
  if (!isFinite(ms)) return '';
  if (ms < 0) return 'in ' + fmtDuration(-ms);
  return fmtDuration(ms) + ' ago';
}

function fmtDuration(ms) {
  if (ms < 1000) return Math.round(ms) + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + ' s';
  if (ms < 3600000) return Math.floor(ms / 60000) + ' min ' + Math.round((ms % 60000) / 1000) + ' s';
  return (ms / 3600000).toFixed(1) + ' h';
}

function fmtNum(n, digits) {
  if (n === null || n === undefined || !isFinite(n)) return '—';
  return Number(n).toLocaleString('en-US', {maximumFractionDigits: digits ?? 0, minimumFractionDigits: digits ?? 0});
}

function fmtPct(x) {
  if (x === null || x === undefined || !isFinite(x)) return '—';
  return (100 * x).toFixed(x > 0 && x < 0.001 ? 3 : 1) + ' %';
}

function prettyJSON(raw) {
  if (raw === null || raw === undefined) return 'null';
  try { return JSON.stringify(raw, null, 2); } catch { return String(raw); }
}

// stuckStep is the step a skip would name: the failed compensation of a
// failed saga, the failed forward step of a parked one, else the step in
// flight.
function stuckStep(s) {
  const phase = s.state === 'failed' ? 'compensate' : s.state === 'parked' ? 'forward' : '';
  if (phase) return s.steps.filter(st => st.phase === phase && st.status === 'failed').pop();
  return s.steps.find(st => ['retrying', 'dispatched', 'waiting'].includes(st.status));
}

function compactJSON(raw) {
  try { return JSON.stringify(raw); } catch { return String(raw); }
}

// stateInfo says how to show a saga's state: its label and class. A
// finished saga in a step's state completed.
function stateInfo(s) {
  const st = s.state;
  if (st === 'compensated') return {label: 'compensated', cls: 'warn'};
  if (NEEDS_PERSON.has(st)) return {label: st, cls: 'bad'};
  if (st === 'closed') return {label: 'closed', cls: 'muted'};
  if (s.finished_at) return {label: 'completed', cls: 'ok', detail: st};
  if (st === 'compensating') return {label: 'compensating', cls: 'run'};
  return {label: 'running', cls: 'run', detail: st};
}

function stateBadge(s, id) {
  const i = stateInfo(s);
  return h('span', {class: 'badge ' + i.cls, id, dataset: {state: s.state}}, i.label,
    i.detail ? h('small', null, ' ' + i.detail) : null);
}

function outcomeClass(o) {
  switch (o) {
    case 'succeeded': return 'ok';
    case 'failed': return 'bad';
    case 'unknown': case 'lease expired': return 'warn';
    case 'retry': return 'warn';
    case null: case undefined: return 'run';
  }
  return 'muted';
}

function statusClass(st) {
  switch (st) {
    case 'succeeded': return 'ok';
    case 'failed': return 'bad';
    case 'retrying': return 'warn';
  }
  return 'run';
}

function problemText(err) {
  if (!(err instanceof APIError)) return String(err && err.message || err);
  const p = err.problem || {};
  const head = err.status ? err.status + ' ' + (p.title || 'Error') : (p.title || 'Error');
  return head + (p.detail ? ': ' + p.detail : '');
}

function errorBox(err, id) {
  return h('div', {class: 'error', role: 'alert', id}, problemText(err));
}

// ---- the API -----------------------------------------------------------

class APIError extends Error {
  constructor(status, problem, retryAfter) {
    super((problem && problem.detail) || 'request failed');
    this.status = status;
    this.problem = problem;
    this.retryAfter = retryAfter;
  }
}

// api sends one request to /v1 with the session's token; it answers
// {data, replayed} or throws an APIError carrying the problem the API
// answered (or a network error, status 0). A 401 shows the sign-in form.
async function api(method, path, opts) {
  opts = opts || {};
  const headers = {Accept: 'application/json'};
  if (session.token) headers.Authorization = 'Bearer ' + session.token;
  if (opts.key) headers['Idempotency-Key'] = opts.key;
  let body;
  if (opts.body !== undefined) {
    headers['Content-Type'] = 'application/json';
    body = typeof opts.body === 'string' ? opts.body : JSON.stringify(opts.body);
  }
  let res;
  try {
    res = await fetch(BASE + path.replace(/^\//, ''), {method, headers, body, cache: 'no-store', credentials: 'omit', redirect: 'error'});
  } catch (e) {
    throw new APIError(0, {title: 'No answer', detail: 'the server did not answer (' + e.message + '); check that the worker runs, then try again'});
  }
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!res.ok) {
    const problem = data && data.detail ? data : {title: res.statusText, detail: text.trim()};
    const err = new APIError(res.status, problem, res.headers.get('Retry-After'));
    if (res.status === 401 && !opts.signingIn) {
      session.authRequired = true;
      // A first visit just asks; a token that stopped working says so.
      signIn(session.token ? err : null);
    }
    throw err;
  }
  return {data, replayed: res.headers.get('Idempotent-Replayed') === 'true'};
}

// newKey makes the Idempotency-Key of one repair intent: printable ASCII,
// unique, sent again unchanged when the same request is resent.
function newKey(op) {
  const b = new Uint8Array(12);
  crypto.getRandomValues(b);
  return 'console-' + op + '-' + Array.from(b, x => x.toString(16).padStart(2, '0')).join('');
}

// ---- session -----------------------------------------------------------

function setToken(tok) {
  session.token = tok;
  if (tok) sessionStorage.setItem(TOKEN_KEY, tok);
  else sessionStorage.removeItem(TOKEN_KEY);
  renderSession();
}

function renderSession() {
  const st = document.getElementById('session-state');
  const out = document.getElementById('sign-out');
  if (session.token) {
    st.textContent = 'signed in with a token';
    out.hidden = false;
  } else {
    st.textContent = session.authRequired ? 'not signed in' : 'no token needed';
    out.hidden = true;
  }
}

// signIn replaces the page with the token form; nothing of the data stays.
function signIn(err) {
  stopView();
  setToken('');
  samples.length = 0;
  setNav(null);
  const input = h('input', {type: 'password', id: 'token', name: 'token', autocomplete: 'off', required: true, size: 48,
    placeholder: 'API token', 'aria-label': 'API token'});
  const msg = h('p', {id: 'login-error', class: 'error', role: 'alert', hidden: !err}, err ? problemText(err) : '');
  const form = h('form', {id: 'login', class: 'card login', onsubmit: async ev => {
    ev.preventDefault();
    const tok = input.value.trim();
    if (!tok) return;
    session.token = tok;
    try {
      await loadDefinitions(true);
    } catch (e) {
      session.token = '';
      msg.textContent = e.status === 401 ? 'That token was refused: ' + problemText(e) : problemText(e);
      msg.hidden = false;
      return;
    }
    setToken(tok);
    route();
  }},
  h('h1', null, 'Sign in'),
  h('p', null, 'This worker requires an API token (one line of its --api-tokens-file). It is kept in this tab only and sent as a bearer token with every request.'),
  h('label', null, 'Token ', input),
  h('button', {type: 'submit', id: 'login-btn', class: 'primary'}, 'Sign in'),
  msg);
  show(form);
  input.focus();
}

async function loadDefinitions(signingIn) {
  const {data} = await api('GET', 'v1/definitions', {signingIn});
  session.definitions = data.definitions || [];
}

// ---- routing -----------------------------------------------------------

function stopView() {
  viewSeq++;
  for (const t of viewTimers) clearInterval(t);
  viewTimers = [];
}

// every runs the async fn each ms while the tab is visible (a hidden
// console costs the server nothing), never two at once: a slow answer
// delays the next poll rather than piling requests up.
function every(ms, fn) {
  let busy = false;
  viewTimers.push(setInterval(async () => {
    if (busy || document.hidden) return;
    busy = true;
    try { await fn(); } finally { busy = false; }
  }, ms));
}

function setNav(view) {
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('active', a.dataset.view === view);
  }
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, query] = raw.split('?');
  return {parts: path.split('/').filter(Boolean), params: new URLSearchParams(query || '')};
}

function route() {
  stopView();
  if (session.authRequired && !session.token) {
    signIn();
    return;
  }
  const {parts, params} = parseHash();
  switch (parts[0]) {
    case 'saga':
      setNav('sagas');
      sagaView(parts[1]);
      break;
    case 'live':
      setNav('live');
      liveView();
      break;
    default:
      setNav('sagas');
      listView(params);
  }
}

// ---- the sagas list ----------------------------------------------------

function listHash(params) {
  const q = new URLSearchParams();
  for (const k of ['definition', 'state', 'cursor']) if (params.get(k)) q.set(k, params.get(k));
  const s = q.toString();
  return '#/sagas' + (s ? '?' + s : '');
}

function statesFor(definition) {
  const seen = [];
  for (const d of session.definitions) {
    if (definition && d.name !== definition) continue;
    for (const s of d.states) if (!seen.includes(s)) seen.push(s);
  }
  return seen;
}

function listView(params) {
  const seq = viewSeq;
  const definition = params.get('definition') || '';
  const stateFilter = params.get('state') || '';
  const cursor = params.get('cursor') || '';

  const go = changes => {
    const p = new URLSearchParams(params);
    for (const [k, v] of Object.entries(changes)) { if (v) p.set(k, v); else p.delete(k); }
    if (!('cursor' in changes)) p.delete('cursor');
    location.hash = listHash(p);
  };
  const defSelect = h('select', {id: 'filter-definition', onchange: () => go({definition: defSelect.value, state: ''})},
    h('option', {value: ''}, 'every definition'),
    session.definitions.map(d => h('option', {value: d.name, selected: d.name === definition}, d.name + ' (v' + d.version + ')')));
  const stateSelect = h('select', {id: 'filter-state', onchange: () => go({state: stateSelect.value})},
    h('option', {value: ''}, 'every state'),
    statesFor(definition).map(s => h('option', {value: s, selected: s === stateFilter}, s)));
  const counts = h('div', {id: 'counts', class: 'counts'});
  const table = h('tbody', {id: 'saga-rows'});
  const status = h('div', {id: 'list-status', class: 'muted small'});
  const errors = h('div', {id: 'list-error'});
  const pager = h('div', {class: 'pager'});

  show(
    h('section', {class: 'card'},
      h('div', {class: 'row'},
        h('h1', null, 'Sagas'),
        h('form', {class: 'filters', onsubmit: ev => ev.preventDefault()},
          h('label', null, 'Definition ', defSelect),
          h('label', null, 'State ', stateSelect),
          (definition || stateFilter) ? h('button', {type: 'button', class: 'link', id: 'filter-clear', onclick: () => go({definition: '', state: ''})}, 'clear filters') : null)),
      counts),
    errors,
    h('section', {class: 'card'},
      h('table', {class: 'grid', id: 'sagas'},
        h('thead', null, h('tr', null, ['State', 'Definition', 'Key', 'Saga', 'Error', 'Created', 'Updated'].map(c => h('th', null, c)))),
        table),
      h('div', {class: 'row'}, status, pager)));

  const load = async () => {
    const q = new URLSearchParams({limit: '50'});
    if (definition) q.set('definition', definition);
    if (stateFilter) q.set('state', stateFilter);
    if (cursor) q.set('cursor', cursor);
    let data;
    try {
      ({data} = await api('GET', 'v1/sagas?' + q));
    } catch (e) {
      if (seq !== viewSeq) return;
      errors.replaceChildren(errorBox(e));
      return;
    }
    if (seq !== viewSeq) return;
    errors.replaceChildren();
    renderCounts(counts, data.counts || {}, stateFilter, go, definition);
    table.replaceChildren(...data.sagas.map(sagaRow));
    if (data.sagas.length === 0) {
      table.append(h('tr', null, h('td', {colspan: 7, class: 'muted'}, (definition || stateFilter) ? 'No saga matches these filters.' : 'No sagas yet.')));
    }
    pager.replaceChildren(...[
      cursor ? h('a', {href: listHash(new URLSearchParams({definition, state: stateFilter})), class: 'button'}, '⇤ newest') : null,
      data.next_cursor ? h('a', {href: listHash(new URLSearchParams({definition, state: stateFilter, cursor: data.next_cursor})), class: 'button', id: 'older'}, 'older →') : null].filter(Boolean));
    status.textContent = data.sagas.length + ' shown' + (cursor ? '' : ', refreshed every ' + LIST_REFRESH_MS / 1000 + ' s') + ' · ' + new Date().toLocaleTimeString();
  };
  load();
  // A later page does not move under the reader.
  if (!cursor) every(LIST_REFRESH_MS, load);
}

function renderCounts(el, counts, active, go, definition) {
  const states = statesFor(definition).filter(s => counts[s] !== undefined);
  for (const s of Object.keys(counts)) if (!states.includes(s)) states.push(s);
  let total = 0;
  for (const s of states) total += counts[s];
  const chip = (s, n, label) => h('button', {type: 'button', class: 'chip' + (s === active ? ' active' : '') + (NEEDS_PERSON.has(s) && n > 0 ? ' alarm' : ''),
    dataset: {state: s || 'all', count: n}, onclick: () => go({state: s === active ? '' : s})},
  h('span', {class: 'n'}, fmtNum(n)), ' ', label || s);
  el.replaceChildren(chip('', total, 'all'), ...states.map(s => chip(s, counts[s])));
  const attention = (counts.failed || 0) + (counts.parked || 0);
  if (attention > 0) {
    el.append(h('span', {class: 'attention', id: 'attention'}, attention + (attention === 1 ? ' saga needs' : ' sagas need') + ' a person'));
  }
}

function sagaRow(s) {
  const link = '#/saga/' + s.id;
  return h('tr', {class: 'clickable', dataset: {id: s.id, state: s.state}, onclick: ev => { if (ev.target.tagName !== 'A') location.hash = link; }},
    h('td', null, stateBadge(s)),
    h('td', null, s.definition),
    h('td', {class: 'mono'}, s.key),
    h('td', {class: 'mono small'}, h('a', {href: link}, s.id)),
    h('td', {class: 'err-cell', title: s.error || ''}, s.error ? h('div', {class: 'clamp'}, s.error) : ''),
    h('td', {title: fmtTime(s.created_at)}, fmtAgo(s.created_at)),
    h('td', {title: fmtTime(s.updated_at)}, fmtAgo(s.updated_at)));
}

// ---- one saga ----------------------------------------------------------

const REPAIRS = [
  {op: 'retry', label: 'Retry', help: 'Run the failed step again under its key, at its next attempt (failed, parked, or waiting out a backoff).'},
  {op: 'cancel', label: 'Cancel', help: 'Stop the saga and compensate what it completed.', danger: true},
  {op: 'skip', label: 'Skip…', help: 'Mark a step succeeded with the result the other system gave, and go on.', danger: true},
  {op: 'close', label: 'Close', help: 'Close a failed or parked saga as handled by hand; nothing runs for it any more.', danger: true},
  {op: 'pause', label: 'Pause', help: 'Start no attempt of this saga until it is resumed.'},
  {op: 'resume', label: 'Resume', help: 'Let a paused saga run again; a held step is sent again at its attempt.'},
];

function sagaView(id) {
  const seq = viewSeq;
  const head = h('section', {class: 'card', id: 'saga-head'}, h('p', {class: 'muted'}, 'Loading saga ' + id + '…'));
  const repair = repairPanel(id, () => load());
  const body = h('div', {id: 'saga-body'});
  const errors = h('div', {id: 'saga-error'});
  show(h('p', null, h('a', {href: '#/sagas'}, '← sagas')), errors, head, repair.el, body);
  let last = '';
  const load = async () => {
    let data;
    try {
      ({data} = await api('GET', 'v1/sagas/' + encodeURIComponent(id)));
    } catch (e) {
      if (seq !== viewSeq) return;
      errors.replaceChildren(errorBox(e));
      return;
    }
    if (seq !== viewSeq) return;
    errors.replaceChildren();
    // Re-render only what changed, so that a reader's selection holds.
    const text = JSON.stringify(data);
    if (text === last) return;
    last = text;
    repair.update(data);
    head.replaceChildren(...sagaHead(data));
    body.replaceChildren(...sagaBody(data));
  };
  load();
  every(SAGA_REFRESH_MS, load);
}

function sagaHead(s) {
  const dl = (...pairs) => h('dl', {class: 'facts'}, pairs.filter(Boolean).map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
  return [
    h('div', {class: 'row'},
      h('h1', null, s.definition, h('small', null, ' v' + s.definition_version), ' ', stateBadge(s, 'saga-state')),
      h('span', {class: 'muted mono', id: 'saga-id'}, s.id)),
    dl(['Key', h('span', {class: 'mono', id: 'saga-key'}, s.key)],
      ['State', h('span', {class: 'mono'}, s.state), ' (version ' + s.version + ')'],
      ['Created', fmtTime(s.created_at)],
      ['Updated', fmtTime(s.updated_at) + ' · ' + fmtAgo(s.updated_at)],
      ['Finished', s.finished_at ? fmtTime(s.finished_at) + ' · took ' + fmtDuration(new Date(s.finished_at) - new Date(s.created_at)) : 'not yet'],
      s.deadline_at ? ['Deadline', fmtTime(s.deadline_at)] : null,
      s.paused ? ['Paused', h('span', {class: 'badge warn'}, s.paused.definition ? 'with its definition ' + s.paused.definition : 'itself'), ' since ' + fmtTime(s.paused.since)] : null),
    // Red while a person is needed; afterwards the error stays as history.
    s.error ? h('div', {class: 'saga-error'}, h('h3', null, 'Error recorded with the saga'),
      h('pre', {class: NEEDS_PERSON.has(s.state) ? 'error' : 'note', id: 'saga-error-text'}, s.error)) : null,
  ];
}

function section(title, id, ...children) {
  return h('section', {class: 'card', id}, h('h2', null, title), ...children);
}

function sagaBody(s) {
  const out = [];
  out.push(section('Timeline', 'timeline', timeline(s)));
  out.push(section('Steps', 'steps',
    h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['#', 'Step', 'Phase', 'Kind', 'Status', 'Attempt', 'Step key', 'Lease / next attempt', 'Last error', 'Result'].map(c => h('th', null, c)))),
      h('tbody', null, s.steps.map(st => h('tr', {dataset: {step: st.step, phase: st.phase, status: st.status}},
        h('td', null, st.index),
        h('td', null, st.step),
        h('td', null, st.phase),
        h('td', null, st.kind),
        h('td', null, h('span', {class: 'badge ' + statusClass(st.status)}, st.status), st.possibly_done ? h('span', {class: 'badge warn', title: 'an attempt\'s outcome at another system is unknown: it may have taken effect'}, 'possibly done') : null),
        h('td', null, st.attempt),
        h('td', {class: 'mono small'}, st.key),
        h('td', {class: 'small'}, st.next_attempt_at ? 'next ' + fmtTime(st.next_attempt_at) : st.lease_until ? 'lease until ' + fmtTime(st.lease_until) : '—',
          st.callback_token ? h('div', {class: 'mono'}, 'callback token ' + st.callback_token) : null),
        h('td', {class: 'err-cell'}, st.last_error || ''),
        h('td', {class: 'mono small'}, st.result ? compactJSON(st.result) : '')))))));
  out.push(section('Input and results', 'data',
    h('div', {class: 'cols'},
      h('div', null, h('h3', null, 'Input'), h('pre', {class: 'json'}, prettyJSON(s.input))),
      h('div', null, h('h3', null, 'Results'), Object.keys(s.results).length ? h('pre', {class: 'json', id: 'saga-results'}, prettyJSON(s.results)) : h('p', {class: 'muted'}, 'No step completed yet.')))));
  out.push(section('Repairs', 'repairs', s.repairs.length === 0 ? h('p', {class: 'muted'}, 'No repair yet.') :
    h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['At', 'Operation', 'Step', 'State after', 'By', 'Reason', 'Idempotency-Key'].map(c => h('th', null, c)))),
      h('tbody', null, s.repairs.map(r => h('tr', {dataset: {operation: r.operation}},
        h('td', null, fmtTime(r.at)), h('td', null, r.operation), h('td', null, r.step ? r.step + ' (' + r.phase + ')' : ''),
        h('td', null, r.state_after), h('td', null, r.by || ''), h('td', null, r.reason || ''), h('td', {class: 'mono small'}, r.key)))))));
  if (s.callbacks.length) {
    out.push(section('Callbacks', 'callbacks', h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['Received', 'Step', 'Event id', 'Outcome', 'Applied', 'Result or error'].map(c => h('th', null, c)))),
      h('tbody', null, s.callbacks.map(c => h('tr', null,
        h('td', null, fmtTime(c.received_at)), h('td', null, c.step), h('td', {class: 'mono small'}, c.event_id),
        h('td', null, h('span', {class: 'badge ' + (c.outcome === 'applied' ? 'ok' : 'muted')}, c.outcome), c.failed ? h('span', {class: 'badge bad'}, 'refused') : null),
        h('td', null, fmtTime(c.applied_at)),
        h('td', null, c.error ? h('span', {class: 'err-cell'}, c.error) : c.result ? h('pre', {class: 'json'}, prettyJSON(c.result)) : '')))))));
  }
  if (s.dead_letters.length) {
    out.push(section('Dead letters', 'dead-letters', h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['Step', 'Phase', 'Attempt', 'Deliveries', 'Reason', 'Last seen'].map(c => h('th', null, c)))),
      h('tbody', null, s.dead_letters.map(d => h('tr', null,
        h('td', null, d.step), h('td', null, d.phase), h('td', null, d.attempt), h('td', null, d.deliveries),
        h('td', {class: 'err-cell'}, d.reason), h('td', null, fmtTime(d.last_seen))))))));
  }
  return out;
}

// timeline draws every attempt in dispatch order, with the repairs and
// callbacks between them at their time.
function timeline(s) {
  const events = [];
  for (const a of s.attempts) events.push({at: a.dispatched_at, kind: 'attempt', a});
  // The attempt a repair sends is written in the repair's transaction,
  // moments before the repair's own record: the repair goes first.
  for (const r of s.repairs) {
    let at = new Date(r.at).getTime();
    for (const a of s.attempts) {
      const d = new Date(a.dispatched_at).getTime();
      if (d <= at && at - d < 250) at = d;
    }
    events.push({at: new Date(at).toISOString(), kind: 'repair', r});
  }
  for (const c of s.callbacks) events.push({at: c.received_at, kind: 'callback', c});
  events.push({at: s.created_at, kind: 'created'});
  if (s.finished_at) events.push({at: s.finished_at, kind: 'finished'});
  const order = {created: 0, repair: 1, attempt: 2, callback: 3, finished: 4};
  events.sort((x, y) => (new Date(x.at) - new Date(y.at)) || (order[x.kind] - order[y.kind]));
  const t0 = new Date(s.created_at).getTime();
  const rel = at => '+' + fmtDuration(Math.max(0, new Date(at).getTime() - t0));
  return h('ol', {class: 'timeline'}, events.map(ev => {
    switch (ev.kind) {
      case 'created':
        return h('li', {class: 'ev muted'}, h('span', {class: 'when'}, fmtTime(ev.at)), h('span', {class: 'what'}, 'saga created with key ', h('span', {class: 'mono'}, s.key)));
      case 'finished': {
        const i = stateInfo(s);
        return h('li', {class: 'ev ' + i.cls}, h('span', {class: 'when'}, rel(ev.at)), h('span', {class: 'what'}, 'saga ', h('b', null, i.label), ' (state ' + s.state + ')'));
      }
      case 'repair':
        return h('li', {class: 'ev repair'}, h('span', {class: 'when'}, rel(ev.r.at)),
          h('span', {class: 'what'}, 'repair ', h('b', null, ev.r.operation), ev.r.step ? ' of ' + ev.r.step : '', ' by ' + (ev.r.by || '?'),
            ev.r.reason ? ' — ' + ev.r.reason : '', ' → ' + ev.r.state_after));
      case 'callback':
        return h('li', {class: 'ev'}, h('span', {class: 'when'}, rel(ev.at)),
          h('span', {class: 'what'}, 'callback for ' + ev.c.step + ' (event ' + ev.c.event_id + '): ' + ev.c.outcome));
    }
    const a = ev.a;
    const took = a.finished_at ? fmtDuration(new Date(a.finished_at) - new Date(a.dispatched_at)) : 'in flight';
    return h('li', {class: 'ev ' + outcomeClass(a.outcome), dataset: {step: a.step, phase: a.phase, attempt: a.attempt, outcome: a.outcome || 'in flight'}},
      h('span', {class: 'when'}, rel(ev.at)),
      h('span', {class: 'what'},
        h('b', null, a.step), ' ', a.phase === 'compensate' ? h('span', {class: 'badge warn'}, 'compensate') : null,
        ' attempt ' + a.attempt + ' ', h('span', {class: 'badge ' + outcomeClass(a.outcome)}, a.outcome || 'in flight'), ' ' + took,
        h('div', {class: 'mono small muted'}, 'key ' + a.key),
        a.error ? h('div', {class: 'err-cell'}, a.error) : null));
  }));
}

// repairPanel holds the repair buttons and the form of the chosen one.
// The form keeps its Idempotency-Key while its request is unchanged, so
// sending again after no answer, or a 409 in flight, is the same intent;
// a success, or an edit, makes the next send a new one.
function repairPanel(id, reload) {
  let current = null; // {op, key}
  let saga = null;
  const buttons = h('div', {class: 'buttons'}, REPAIRS.map(r => h('button', {type: 'button', id: 'repair-' + r.op, class: r.danger ? 'danger' : '', title: r.help,
    onclick: () => open(r)}, r.label)));
  const form = h('form', {id: 'repair-form', class: 'repair-form', hidden: true});
  const result = h('div', {id: 'repair-result', 'aria-live': 'polite'});
  const el = h('section', {class: 'card', id: 'repair'},
    h('div', {class: 'row'}, h('h2', null, 'Repair'), h('span', {class: 'muted small'}, 'Underlined: what the saga\'s state usually allows. The API decides, and says why when it refuses.')),
    buttons, form, result);

  function open(r) {
    current = {op: r.op, key: newKey(r.op)};
    for (const b of buttons.children) b.classList.toggle('active', b.id === 'repair-' + r.op);
    const keyLine = h('span', {class: 'mono small', id: 'repair-key'}, current.key);
    const edited = () => { current.key = newKey(r.op); keyLine.textContent = current.key; };
    const reason = h('input', {type: 'text', id: 'repair-reason', size: 50, placeholder: 'why (recorded with the repair)', oninput: edited});
    const fields = [h('label', null, 'Reason ', reason)];
    let step, res;
    if (r.op === 'skip') {
      const names = [];
      for (const st of (saga ? saga.steps : [])) if (!names.includes(st.step)) names.push(st.step);
      const at = saga && stuckStep(saga);
      step = h('select', {id: 'repair-step', onchange: edited}, names.map(n => h('option', {value: n, selected: at && at.step === n}, n)));
      res = h('textarea', {id: 'repair-result-json', rows: 3, cols: 50, spellcheck: 'false', oninput: edited}, 'null');
      fields.unshift(h('label', null, 'Step ', step),
        h('label', {class: 'block'}, 'Result: the JSON the step answered at the other system, which later steps read (null for none; a compensation\'s is ignored) ', res));
    }
    form.replaceChildren(
      h('p', {class: 'muted'}, r.help),
      ...fields,
      h('div', {class: 'row'},
        h('button', {type: 'submit', id: 'repair-send', class: r.danger ? 'danger' : 'primary'}, 'Send ' + r.op),
        h('button', {type: 'button', class: 'link', onclick: () => { form.hidden = true; current = null; for (const b of buttons.children) b.classList.remove('active'); }}, 'cancel'),
        h('span', {class: 'muted small'}, 'Idempotency-Key ', keyLine)));
    form.onsubmit = async ev => {
      ev.preventDefault();
      // The body is written by hand so that the result goes as typed:
      // the API, not the browser's lenient parser, judges it.
      const members = [];
      if (r.op === 'skip') {
        const text = res.value.trim() || 'null';
        try {
          JSON.parse(text);
        } catch (e) {
          result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'repair-error'},
            'The result is not JSON (' + e.message + '); write the JSON the step answered, or null for none. Nothing was sent.'));
          return;
        }
        members.push('"step":' + JSON.stringify(step.value), '"result":' + text);
      }
      if (reason.value.trim()) members.push('"reason":' + JSON.stringify(reason.value.trim()));
      const send = form.querySelector('#repair-send');
      send.disabled = true;
      result.replaceChildren(h('p', {class: 'muted'}, 'Sending ' + r.op + '…'));
      try {
        const {data, replayed} = await api('POST', 'v1/sagas/' + encodeURIComponent(id) + '/' + r.op,
          {key: current.key, body: members.length ? '{' + members.join(',') + '}' : undefined});
        result.replaceChildren(h('div', {class: 'success', id: 'repair-ok', role: 'status'},
          data.operation + (replayed ? ' was already done with this key (replayed)' : ' done') + ': the saga is now ' + data.state + ' · ' + fmtTime(data.at)));
        form.hidden = true;
        for (const b of buttons.children) b.classList.remove('active');
        current = null;
        reload();
      } catch (e) {
        const again = e.status === 0 || e.status >= 500 || (e.status === 409 && e.retryAfter);
        result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'repair-error'}, problemText(e),
          again ? h('div', {class: 'small'}, 'Sending again uses the same Idempotency-Key, so the repair happens at most once.') : null));
      } finally {
        send.disabled = false;
      }
    };
    form.hidden = false;
    result.replaceChildren();
    (r.op === 'skip' ? step : reason).focus();
  }

  return {
    el,
    update(s) {
      saga = s;
      // The API decides what a state allows; the buttons only hint.
      const hint = {
        retry: NEEDS_PERSON.has(s.state) || (!s.finished_at && s.steps.some(st => st.status === 'retrying')),
        cancel: !s.finished_at || s.state === 'parked',
        skip: NEEDS_PERSON.has(s.state) || !s.finished_at,
        close: NEEDS_PERSON.has(s.state),
        pause: !s.finished_at && !s.paused,
        resume: !!s.paused,
      };
      for (const b of buttons.children) b.classList.toggle('suggested', !!hint[b.id.replace('repair-', '')]);
    },
  };
}

// ---- live figures ------------------------------------------------------

function liveView() {
  const seq = viewSeq;
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
    let data;
    try {
      ({data} = await api('GET', 'v1/stats'));
    } catch (e) {
      if (seq !== viewSeq) return;
      errors.replaceChildren(errorBox(e));
      return;
    }
    if (seq !== viewSeq) return;
    errors.replaceChildren();
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
  const stream = last.stream_messages;
  const age = last.stream_oldest_message_seconds;
  cards.replaceChildren(
    tile('live-finished', 'Sagas finished / s', fmtNum(finishedRate, 1), fmtNum(total(last.sagas_finished)) + ' in all'),
    tile('live-started', 'Sagas started / s', fmtNum(startedRate, 1), fmtNum(last.sagas_started) + ' in all'),
    tile('live-attempts', 'Step attempts / s', fmtNum(attemptsRate, 1), fmtNum(total(last.step_attempts)) + ' in all'),
    tile('live-hit', 'Duplicates absorbed', fmtNum(dupTotal), 'hit rate ' + fmtPct(seenTotal ? dupTotal / seenTotal : null) + ' of ' + fmtNum(seenTotal) + ' seen'),
    tile('live-stream', 'Stream backlog', stream === null ? 'unknown' : fmtNum(stream), age === null ? 'the stream could not be read' : 'oldest ' + fmtDuration(1000 * age),
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

// ---- start -------------------------------------------------------------

async function boot() {
  document.getElementById('sign-out').addEventListener('click', () => {
    session.authRequired = true;
    signIn();
  });
  window.addEventListener('hashchange', route);
  try {
    await loadDefinitions(false);
  } catch (e) {
    if (e.status === 401) return; // the sign-in form is up
    show(errorBox(e, 'boot-error'), h('p', null, h('button', {type: 'button', onclick: () => location.reload()}, 'Try again')));
    return;
  }
  renderSession();
  route();
}

boot();
