// One saga: its facts, the repair buttons, the timeline of its attempts,
// repairs and callbacks, its steps, input and results.
import {NEEDS_PERSON, api, compactJSON, every, fmtDuration, fmtTime, fmtAgo, h, newKey, outcomeClass, prettyJSON,
  problemText, show, stateBadge, stateInfo, statusClass, stopTimers, view, viewGet, canRepair, session} from './common.js';

const SAGA_REFRESH_MS = 1000;

const REPAIRS = [
  {op: 'retry', label: 'Retry', help: 'Run the failed step again under its key, at its next attempt (failed, parked, or waiting out a backoff).'},
  {op: 'cancel', label: 'Cancel', help: 'Stop the saga and compensate what it completed.', danger: true},
  {op: 'skip', label: 'Skip…', help: 'Mark a step succeeded with the result the other system gave, and go on.', danger: true},
  {op: 'close', label: 'Close', help: 'Close a failed or parked saga as handled by hand; nothing runs for it any more.', danger: true},
  {op: 'pause', label: 'Pause', help: 'Start no attempt of this saga until it is resumed.'},
  {op: 'resume', label: 'Resume', help: 'Let a paused saga run again; a held step is sent again at its attempt.'},
  // Shown only while the saga is held by its definition's pause, which
  // the saga's own resume cannot lift.
  {op: 'resume-definition', label: 'Resume definition', help: 'Lift the pause of this saga\'s definition: every saga of it runs again, this one too.',
    path: s => 'v1/definitions/' + encodeURIComponent(s.definition) + '/resume', shown: s => !!(s.paused && s.paused.definition)},
];

// sagaView shows saga id, read again every second.
export function sagaView(id) {
  const seq = view.seq;
  const head = h('section', {class: 'card', id: 'saga-head'}, h('p', {class: 'muted'}, 'Loading saga ' + id + '…'));
  const repair = repairPanel(id, () => load());
  const body = h('div', {id: 'saga-body'});
  const errors = h('div', {id: 'saga-error'});
  show(h('p', null, h('a', {href: '#/sagas'}, '← sagas')), errors, head, repair.el, body);
  let last = '';
  const load = async () => {
    const data = await viewGet('v1/sagas/' + encodeURIComponent(id), seq, errors, e => {
      // No saga to repair, and none will come by asking again.
      if (e.status === 400 || e.status === 404) {
        stopTimers();
        repair.el.hidden = true;
        head.replaceChildren(h('p', {class: 'muted'}, 'No saga to show. ', h('a', {href: '#/sagas?key=' + encodeURIComponent(id)}, 'Look for "' + id + '" as a key'), '.'));
      }
    });
    if (data === null) return;
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
      ['State', h('span', null, h('span', {class: 'mono'}, s.state), ' (version ' + s.version + ')')],
      ['Created', h('span', {id: 'saga-created'}, fmtTime(s.created_at))],
      ['Updated', fmtTime(s.updated_at) + ' · ' + fmtAgo(s.updated_at)],
      ['Finished', s.finished_at ? fmtTime(s.finished_at) + ' · took ' + fmtDuration(new Date(s.finished_at) - new Date(s.created_at)) : 'not yet'],
      s.parent ? ['Parent', h('span', null, h('a', {href: '#/saga/' + s.parent, class: 'mono', id: 'saga-parent'}, s.parent), ' (its step ' + s.parent_step + ' started this saga)')] : null,
      s.deadline_at ? ['Deadline', fmtTime(s.deadline_at)] : null,
      s.paused ? ['Paused', h('span', {class: 'badge warn'}, s.paused.definition ? 'with its definition ' + s.paused.definition : 'itself'), ' since ' + fmtTime(s.paused.since)] : null),
    // Red while a person is needed; afterwards the error stays as history.
    s.error ? h('div', {class: 'saga-error'}, h('h3', null, 'Error recorded with the saga'),
      h('pre', {class: NEEDS_PERSON.has(s.state) ? 'error' : 'note', id: 'saga-error-text'}, s.error)) : null,
  ].filter(Boolean);
}

function section(title, id, ...children) {
  return h('section', {class: 'card', id}, h('h2', null, title), ...children);
}

function sagaBody(s) {
  const out = [];
  if (s.plan && s.plan.length) out.push(section('Plan', 'plan', plan(s)));
  out.push(section('Timeline', 'timeline', timeline(s)));
  out.push(section('Steps', 'steps',
    h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['#', 'Step', 'Phase', 'Kind', 'Status', 'Attempt', 'Step key', 'Lease / next attempt', 'Last error', 'Result'].map(c => h('th', null, c)))),
      h('tbody', null, s.steps.map(st => h('tr', {dataset: {step: st.step, phase: st.phase, status: st.status}},
        h('td', null, st.index),
        h('td', null, st.step, st.group ? h('div', {class: 'small muted', title: 'a parallel group: its steps run side by side'}, 'group ' + st.group) : null),
        h('td', null, st.phase),
        h('td', null, st.kind),
        h('td', null, h('span', {class: 'badge ' + statusClass(st.status)}, st.status), st.possibly_done ? h('span', {class: 'badge warn', title: 'an attempt\'s outcome at another system is unknown: it may have taken effect'}, 'possibly done') : null),
        h('td', null, st.attempt),
        h('td', {class: 'mono small'}, st.status === 'skipped' ? '—' : st.key),
        h('td', {class: 'small'}, leaseText(s, st),
          st.callback_token ? h('div', {class: 'mono'}, 'callback token ' + st.callback_token) : null),
        h('td', {class: 'err-cell'}, st.last_error || ''),
        h('td', {class: 'mono small'}, st.result ? compactJSON(st.result) : '')))))));
  if (s.children.length) {
    out.push(section('Child sagas', 'children', h('table', {class: 'grid'},
      h('thead', null, h('tr', null, ['Step', 'Saga', 'Definition', 'State'].map(c => h('th', null, c)))),
      h('tbody', null, s.children.map(c => h('tr', {dataset: {step: c.step}},
        h('td', null, c.step), h('td', {class: 'mono small'}, h('a', {href: '#/saga/' + c.id}, c.id)),
        h('td', null, c.definition), h('td', {class: 'mono'}, c.state)))))));
  }
  out.push(section('Input and results', 'data', s.payloads_redacted ?
    h('p', {class: 'muted', id: 'saga-redacted'}, 'Hidden: this token reads what happened, not what the saga carries (its scope is read). A token of scope start or operator shows the input and results.') :
    h('div', {class: 'cols'},
      h('div', null, h('h3', null, 'Input'), h('pre', {class: 'json'}, prettyJSON(s.input))),
      h('div', null, h('h3', null, 'Results'), Object.keys(s.results || {}).length ? h('pre', {class: 'json', id: 'saga-results'}, prettyJSON(s.results)) : h('p', {class: 'muted'}, 'No step completed yet.')))));
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

// plan draws the forward steps in order, a parallel group's branches
// side by side in one stage, each with its status (and its
// compensation's); a child step links to its child saga.
function plan(s) {
  const child = name => s.children.find(c => c.step === name);
  const box = st => {
    const c = st.kind === 'child' ? child(st.name) : null;
    return h('div', {class: 'plan-step ' + (st.status === 'pending' || st.status === 'skipped' ? 'muted' : statusClass(st.status)), dataset: {step: st.name, status: st.status}},
      h('div', {class: 'plan-name'}, st.name, st.conditional ? h('span', {class: 'small muted', title: 'runs only when its condition holds'}, ' if') : null),
      h('div', {class: 'small muted'}, st.kind + (st.child ? ' → ' + st.child : '')),
      h('span', {class: 'badge ' + (st.status === 'pending' || st.status === 'skipped' ? 'muted' : statusClass(st.status))}, st.status),
      st.compensation ? h('span', {class: 'badge ' + statusClass(st.compensation), title: 'its compensation'}, 'undo ' + st.compensation) : null,
      c ? h('div', {class: 'small'}, h('a', {href: '#/saga/' + c.id}, 'child ' + c.state)) : null);
  };
  const stages = [];
  s.plan.forEach((stage, i) => {
    if (i > 0) stages.push(h('span', {class: 'plan-arrow', 'aria-hidden': 'true'}, '→'));
    stages.push(h('div', {class: 'plan-stage' + (stage.group ? ' plan-group' : ''), dataset: stage.group ? {group: stage.group} : {}},
      stage.group ? h('div', {class: 'small muted'}, 'group ' + stage.group + ': side by side') : null,
      stage.steps.map(box)));
  });
  return h('div', {class: 'plan'}, stages);
}

// unfinished says what an attempt with no outcome is doing: held by a
// pause, waiting for its callback or child, or in flight.
function unfinished(s, a) {
  if (s.paused) return 'held';
  const st = s.steps.find(x => x.step === a.step && x.phase === a.phase);
  if (st && st.status === 'waiting') return st.kind === 'child' ? 'waiting for its child' : 'waiting for its callback';
  return 'in flight';
}

// leaseText is a step's lease or next attempt, or what holds it.
function leaseText(s, st) {
  if (st.status === 'skipped') return 'skipped by its condition: no effect, nothing to compensate';
  if (s.paused && ['dispatched', 'waiting', 'retrying'].includes(st.status)) {
    return s.paused.definition ? 'held by its definition\'s pause' : 'held by its pause';
  }
  if (st.next_attempt_at) return 'next ' + fmtTime(st.next_attempt_at);
  if (st.status === 'waiting' && st.lease_until) return 'waits until ' + fmtTime(st.lease_until);
  if (st.lease_until) return 'lease until ' + fmtTime(st.lease_until);
  return '—';
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
        return h('li', {class: 'ev muted'}, h('span', {class: 'when'}, '+0 ms'), h('span', {class: 'what'}, 'saga created with key ', h('span', {class: 'mono'}, s.key), ' · ' + fmtTime(ev.at)));
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
    const took = a.finished_at ? fmtDuration(new Date(a.finished_at) - new Date(a.dispatched_at)) : 'for ' + fmtDuration(Math.max(0, Date.now() - new Date(a.dispatched_at)));
    return h('li', {class: 'ev ' + outcomeClass(a.outcome), dataset: {step: a.step, phase: a.phase, attempt: a.attempt, outcome: a.outcome || 'in flight'}},
      h('span', {class: 'when'}, rel(ev.at)),
      h('span', {class: 'what'},
        h('b', null, a.step), ' ', a.phase === 'compensate' ? h('span', {class: 'badge warn'}, 'compensate') : null,
        ' attempt ' + a.attempt + ' ', h('span', {class: 'badge ' + outcomeClass(a.outcome)}, a.outcome || unfinished(s, a)), ' ' + took,
        h('div', {class: 'mono small muted'}, 'key ' + a.key),
        a.error ? h('div', {class: 'err-cell'}, a.error) : null));
  }));
}

// repairPanel holds the repair buttons and the form of the chosen one.
// The form keeps its Idempotency-Key while its request is unchanged, so
// sending again after no answer, or a 409 in flight, is the same intent;
// a success, or an edit, makes the next send a new one.
function stuckStep(s) {
  const phase = s.state === 'failed' ? 'compensate' : s.state === 'parked' ? 'forward' : '';
  if (phase) return s.steps.filter(st => st.phase === phase && st.status === 'failed').pop();
  return s.steps.find(st => ['retrying', 'dispatched', 'waiting'].includes(st.status));
}

function repairPanel(id, reload) {
  if (!canRepair()) {
    const el = h('section', {class: 'card', id: 'repair'}, h('h2', null, 'Repair'),
      h('p', {class: 'muted', id: 'repair-not-allowed'}, 'The token ' + session.who.name + ' has scope ' + session.who.scope +
        ': it cannot repair sagas. Sign in with a token of scope operator to retry, cancel, skip, close, pause or resume.'));
    return {el, update() {}};
  }
  let current = null; // {op, key}
  let saga = null;
  const buttons = h('div', {class: 'buttons'}, REPAIRS.map(r => h('button', {type: 'button', id: 'repair-' + r.op, class: r.danger ? 'danger' : '', title: r.help,
    hidden: !!r.shown, onclick: () => open(r)}, r.label)));
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
        const path = r.path ? r.path(saga) : 'v1/sagas/' + encodeURIComponent(id) + '/' + r.op;
        const {data, replayed} = await api('POST', path,
          {key: current.key, body: members.length ? '{' + members.join(',') + '}' : undefined});
        const what = data.definition && !data.state ? 'definition ' + data.definition + ' resumed, ' + data.sagas + ' sagas sent on' : 'the saga is now ' + data.state;
        result.replaceChildren(h('div', {class: data.state === 'parked' || data.state === 'failed' ? 'error' : 'success', id: 'repair-ok', role: 'status'},
          data.operation + (replayed ? ' was already done with this key (replayed)' : ' done') + ': ' + what + ' · ' + fmtTime(data.at),
          data.state === 'parked' ? h('div', {class: 'small', id: 'repair-parked'}, 'Parked, not compensated: a step may have taken effect and has no compensation to undo it. A person must check the other system, then retry, skip or close the saga (its error says which step).') : null,
          data.state === 'failed' ? h('div', {class: 'small'}, 'Failed: a compensation could not finish. A person must repair its effect, then retry or skip it.') : null));
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
        // A saga held by its definition's pause is resumed with it.
        resume: !!s.paused && !s.paused.definition,
        'resume-definition': true,
      };
      for (const b of buttons.children) {
        const r = REPAIRS.find(x => 'repair-' + x.op === b.id);
        b.hidden = !!(r.shown && !r.shown(s));
        b.classList.toggle('suggested', !!hint[r.op]);
      }
    },
  };
}
