// The idemsaga console: a single page over the HTTP API (/v1) of the
// worker that serves it. Every figure and saga shown is read from /v1 with
// the bearer token the operator gave (kept in this tab's sessionStorage).
// This module signs in, routes between the views, and starts the page.
import {TOKEN_KEY, api, errorBox, h, onUnauthorized, problemText, session, setZone, show, stopView, zone, zoneLabel} from './common.js';
import {forgetSamples, liveView} from './live.js';
import {eventsView} from './events.js';
import {sagaView} from './saga.js';
import {listView} from './sagas.js';
import {schedulesView} from './schedules.js';

function setToken(tok) {
  session.token = tok;
  if (!tok) session.who = null;
  if (tok) sessionStorage.setItem(TOKEN_KEY, tok);
  else sessionStorage.removeItem(TOKEN_KEY);
  renderSession();
}

function renderSession() {
  const st = document.getElementById('session-state');
  const out = document.getElementById('sign-out');
  if (session.token) {
    const who = session.who;
    st.textContent = who && who.authenticated ?
      'signed in as ' + who.name + ' (' + who.scope + (who.definitions ? ', ' + who.definitions.join(', ') + ' only' : '') + (who.sees_payloads ? '' : ', data hidden') + ')' :
      'signed in with a token';
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
  forgetSamples();
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

// renderZone labels the time setting's button with the zone in use; a
// press switches between UTC and the browser's zone, and the view is
// drawn again in it.
function renderZone() {
  const b = document.getElementById('time-zone');
  const other = zone() === 'utc' ? 'your browser\'s zone' : 'UTC';
  b.textContent = 'Times: ' + zoneLabel();
  b.title = 'Every time on these pages is shown in ' + zoneLabel() + '. Press to show them in ' + other + ' (remembered in this browser).';
  b.dataset.zone = zone();
}

async function loadDefinitions(signingIn) {
  const {data} = await api('GET', 'v1/definitions', {signingIn});
  session.definitions = data.definitions || [];
  try {
    session.who = (await api('GET', 'v1/whoami', {signingIn})).data;
  } catch (e) {
    session.who = null; // an older server: the header says less
  }
  renderSession();
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
    case 'schedules':
      setNav('schedules');
      schedulesView();
      break;
    case 'events':
      setNav('events');
      eventsView(params);
      break;
    default:
      setNav('sagas');
      listView(params);
  }
}

async function boot() {
  document.getElementById('sign-out').addEventListener('click', () => {
    session.authRequired = true;
    signIn();
  });
  document.getElementById('time-zone').addEventListener('click', () => {
    setZone(zone() === 'utc' ? 'local' : 'utc');
    renderZone();
    route();
  });
  renderZone();
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

onUnauthorized(signIn);
boot();
