// Shared by the console's modules: the session, the API client, the DOM
// and formatting helpers, and the lifecycle of a view. Data is always
// inserted as text, never as markup.

export const TOKEN_KEY = 'idemsaga.console.token';

// The API lives beside /ui/ on the same origin, under whatever prefix a
// proxy put in front of both.
export const BASE = location.pathname.replace(/ui\/[^/]*$/, '');

export const NEEDS_PERSON = new Set(['failed', 'parked']);

export const session = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  // authRequired is learnt from the server's first answer.
  authRequired: false,
  definitions: [],
  // who is GET /v1/whoami's answer: the token's name and scope.
  who: null,
};

// canRepair reports whether the signed-in token may repair (scope
// operator); unknown (an older server, no tokens): yes, and the API decides.
export function canRepair() {
  return !session.who || session.who.scope === 'operator';
}

// The current view: its timers, cleared when the view changes, and a
// sequence number an answer compares against to know it is still wanted.
export const view = {seq: 0, timers: []};

// h builds an element: h('td', {class: 'x'}, 'text', child…). Strings
// become text nodes; attributes starting with "on" are listeners.
export function h(tag, attrs, ...children) {
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

export function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function svg(tag, attrs) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

export function main() { return document.getElementById('main'); }

export function show(...children) {
  const m = main();
  m.replaceChildren();
  append(m, children);
}

// The time setting: every time the console shows goes through fmtTime
// (or fmtClock for a time of day), in UTC or in the browser's zone as
// the operator chose in the header; remembered in localStorage; UTC
// until chosen.
export const ZONE_KEY = 'idemsaga.console.zone';

export function zone() {
  try { return localStorage.getItem(ZONE_KEY) === 'local' ? 'local' : 'utc'; } catch { return 'utc'; }
}

export function setZone(z) {
  try { localStorage.setItem(ZONE_KEY, z === 'local' ? 'local' : 'utc'); } catch { /* private mode: this page only */ }
}

// offsetText is the browser's offset from UTC at d: "+05:30".
function offsetText(d) {
  const m = -d.getTimezoneOffset();
  const a = Math.abs(m);
  return (m < 0 ? '-' : '+') + String(Math.floor(a / 60)).padStart(2, '0') + ':' + String(a % 60).padStart(2, '0');
}

// zoneLabel names the zone times are shown in: "UTC", or "local
// (UTC+05:30)" with the browser's offset now.
export function zoneLabel() {
  return zone() === 'local' ? 'local (UTC' + offsetText(new Date()) + ')' : 'UTC';
}

const pad = (n, w) => String(n).padStart(w || 2, '0');

// parts is d's calendar fields in the chosen zone, and the zone's
// suffix: "UTC", or the browser's offset at d.
function parts(d) {
  if (zone() === 'local') {
    return {y: d.getFullYear(), mo: d.getMonth() + 1, day: d.getDate(), hh: d.getHours(), mm: d.getMinutes(), ss: d.getSeconds(), ms: d.getMilliseconds(), z: offsetText(d)};
  }
  return {y: d.getUTCFullYear(), mo: d.getUTCMonth() + 1, day: d.getUTCDate(), hh: d.getUTCHours(), mm: d.getUTCMinutes(), ss: d.getUTCSeconds(), ms: d.getUTCMilliseconds(), z: 'UTC'};
}

// fmtTime shows a time of the API (RFC 3339) as
// "2006-01-02 15:04:05.000 UTC" or, in local time, with the offset:
// "2006-01-02 20:34:05.000 +05:30".
export function fmtTime(s) {
  if (!s) return '—';
  const d = s instanceof Date ? s : new Date(s);
  if (isNaN(d)) return String(s);
  const p = parts(d);
  return p.y + '-' + pad(p.mo) + '-' + pad(p.day) + ' ' + pad(p.hh) + ':' + pad(p.mm) + ':' + pad(p.ss) + '.' + pad(p.ms, 3) + ' ' + p.z;
}

// fmtClock is a time of day, as the "refreshed at" lines show it.
export function fmtClock(s) {
  const d = s instanceof Date ? s : new Date(s);
  if (isNaN(d)) return '—';
  const p = parts(d);
  return pad(p.hh) + ':' + pad(p.mm) + ':' + pad(p.ss) + ' ' + p.z;
}

// inputValue is the value of a datetime-local input for an RFC 3339
// time, in the chosen zone; inputTime is the RFC 3339 time (UTC) an
// input's value means.
export function inputValue(s) {
  const d = new Date(s);
  if (isNaN(d)) return '';
  const p = parts(d);
  return p.y + '-' + pad(p.mo) + '-' + pad(p.day) + 'T' + pad(p.hh) + ':' + pad(p.mm) + ':' + pad(p.ss);
}

export function inputTime(v) {
  if (!v) return '';
  const d = new Date(zone() === 'local' ? v : v + 'Z');
  return isNaN(d) ? '' : d.toISOString();
}

export function fmtAgo(s) {
  if (!s) return '';
  const ms = Date.now() - new Date(s).getTime();
  if (!isFinite(ms)) return '';
  if (ms < 0) return 'in ' + fmtDuration(-ms);
  return fmtDuration(ms) + ' ago';
}

export function fmtDuration(ms) {
  if (ms < 1000) return Math.round(ms) + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + ' s';
  if (ms < 3600000) return Math.floor(ms / 60000) + ' min ' + Math.round((ms % 60000) / 1000) + ' s';
  return (ms / 3600000).toFixed(1) + ' h';
}

export function fmtNum(n, digits) {
  if (n === null || n === undefined || !isFinite(n)) return '—';
  return Number(n).toLocaleString('en-US', {maximumFractionDigits: digits ?? 0, minimumFractionDigits: digits ?? 0});
}

export function fmtPct(x) {
  if (x === null || x === undefined || !isFinite(x)) return '—';
  return (100 * x).toFixed(x > 0 && x < 0.001 ? 3 : 1) + ' %';
}

export function prettyJSON(raw) {
  if (raw === null || raw === undefined) return 'null';
  try { return JSON.stringify(raw, null, 2); } catch { return String(raw); }
}

// stuckStep is the step a skip would name: the failed compensation of a
// failed saga, the failed forward step of a parked one, else the step in
// flight.
export function compactJSON(raw) {
  try { return JSON.stringify(raw); } catch { return String(raw); }
}

// stateInfo says how to show a saga's state: its label and class. A
// finished saga in a step's state completed.
export function stateInfo(s) {
  const st = s.state;
  if (st === 'compensated') return {label: 'compensated', cls: 'warn'};
  if (NEEDS_PERSON.has(st)) return {label: st, cls: 'bad'};
  if (st === 'closed') return {label: 'closed', cls: 'muted'};
  if (s.finished_at) return {label: 'completed', cls: 'ok', detail: st};
  if (st === 'compensating') return {label: 'compensating', cls: 'run'};
  return {label: 'running', cls: 'run', detail: st};
}

export function stateBadge(s, id) {
  const i = stateInfo(s);
  return h('span', {class: 'badge ' + i.cls, id, dataset: {state: s.state}}, i.label,
    i.detail ? h('small', null, ' ' + i.detail) : null);
}

export function outcomeClass(o) {
  switch (o) {
    case 'succeeded': return 'ok';
    case 'failed': return 'bad';
    case 'unknown': case 'lease expired': return 'warn';
    case 'retry': return 'warn';
    case null: case undefined: return 'run';
  }
  return 'muted';
}

export function statusClass(st) {
  switch (st) {
    case 'succeeded': return 'ok';
    case 'failed': return 'bad';
    case 'retrying': return 'warn';
  }
  return 'run';
}

export function problemText(err) {
  if (!(err instanceof APIError)) return String(err && err.message || err);
  const p = err.problem || {};
  const head = err.status ? err.status + ' ' + (p.title || 'Error') : (p.title || 'Error');
  return head + (p.detail ? ': ' + p.detail : '');
}

export function errorBox(err, id) {
  return h('div', {class: 'error', role: 'alert', id}, problemText(err));
}

export class APIError extends Error {
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

// unauthorized is what a 401 does: main.js shows the sign-in form.
export let unauthorized = () => {};

export function onUnauthorized(fn) { unauthorized = fn; }

export async function api(method, path, opts) {
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
      unauthorized(session.token ? err : null);
    }
    throw err;
  }
  return {data, replayed: res.headers.get('Idempotent-Replayed') === 'true'};
}

// newKey makes the Idempotency-Key of one repair intent: printable ASCII,
// unique, sent again unchanged when the same request is resent.
// viewGet reads path for the view numbered seq: its data, or null when
// the read failed (the error is shown in errors) or another view has
// taken the page meanwhile.
export async function viewGet(path, seq, errors, onError) {
  let data;
  try {
    ({data} = await api('GET', path));
  } catch (e) {
    if (seq === view.seq) {
      errors.replaceChildren(errorBox(e));
      if (onError) onError(e);
    }
    return null;
  }
  if (seq !== view.seq) return null;
  errors.replaceChildren();
  return data;
}

export function newKey(op) {
  const b = new Uint8Array(12);
  crypto.getRandomValues(b);
  return 'console-' + op + '-' + Array.from(b, x => x.toString(16).padStart(2, '0')).join('');
}

export function stopView() {
  view.seq++;
  for (const t of view.timers) clearInterval(t);
  view.timers = [];
}

// stopTimers ends the view's refreshes (a saga that is not there will not
// appear by asking again).
export function stopTimers() {
  for (const t of view.timers) clearInterval(t);
  view.timers = [];
}

export function every(ms, fn) {
  let busy = false;
  view.timers.push(setInterval(async () => {
    if (busy || document.hidden) return;
    busy = true;
    try { await fn(); } finally { busy = false; }
  }, ms));
}
