// The schedules (saga.WithSchedule): each one's cron, last tick, last
// saga started, next tick and pause, with the Pause and Resume buttons
// of POST /v1/schedules/{definition}/pause|resume.
import {api, every, fmtClock, fmtTime, h, newKey, problemText, show, view, viewGet, zoneLabel} from './common.js';

const SCHEDULES_REFRESH_MS = 5000;

const OPS = {
  pause: {label: 'Pause…', help: 'Start no saga at this schedule\'s ticks, in every worker, until it is resumed. The ticks that come due meanwhile are skipped for good; the sagas it started run on.'},
  resume: {label: 'Resume…', help: 'Let the schedule tick again from now on: its next tick is the first after the resume; the ticks of the pause stay skipped.'},
};

// schedulesView lists the recorded schedules, read again every few
// seconds; a table that did not change is not redrawn, so that the
// focus of a keyboard user stays where it was.
export function schedulesView() {
  const seq = view.seq;
  const rows = h('tbody', {id: 'schedule-rows'});
  const errors = h('div', {id: 'schedules-error'});
  const status = h('div', {id: 'schedules-status', class: 'muted small'});
  const panel = schedulePanel(() => load());
  show(
    h('section', {class: 'card'},
      h('div', {class: 'row'},
        h('h1', null, 'Schedules'),
        h('span', {class: 'muted small'}, 'A schedule is recorded when the first worker that runs it starts. A cron is read in UTC unless it starts with CRON_TZ=. Times are shown in ' + zoneLabel() + '.')),
      h('table', {class: 'grid', id: 'schedules'},
        h('thead', null, h('tr', null, ['Definition', 'Cron', 'Last tick', 'Last started', 'Next tick', 'Paused', ''].map(c => h('th', null, c)))),
        rows),
      status),
    errors,
    panel.el);
  let last = '';
  const load = async () => {
    const data = await viewGet('v1/schedules', seq, errors);
    if (data === null) return;
    status.textContent = data.schedules.length + (data.schedules.length === 1 ? ' schedule' : ' schedules') +
      ', refreshed every ' + SCHEDULES_REFRESH_MS / 1000 + ' s · ' + fmtClock(new Date());
    const text = JSON.stringify(data);
    if (text === last) return;
    last = text;
    rows.replaceChildren(...data.schedules.map(s => scheduleRow(s, panel.open)));
    if (data.schedules.length === 0) {
      rows.append(h('tr', null, h('td', {colspan: 7, class: 'muted'}, 'No schedule is recorded: no definition of this deployment has one (saga.WithSchedule), or no worker that runs it has started yet.')));
    }
  };
  load();
  every(SCHEDULES_REFRESH_MS, load);
}

function scheduleRow(s, open) {
  const p = s.paused;
  const op = p ? 'resume' : 'pause';
  return h('tr', {dataset: {definition: s.definition, paused: p ? 'true' : 'false'}},
    h('td', null, h('a', {href: '#/sagas?definition=' + encodeURIComponent(s.definition)}, s.definition)),
    h('td', {class: 'mono'}, s.cron),
    h('td', null, fmtTime(s.last_tick)),
    h('td', null, s.last_started ? fmtTime(s.last_started) : h('span', {class: 'muted'}, 'none yet')),
    h('td', null, s.next ? fmtTime(s.next) : h('span', {class: 'muted', title: 'a newer build\'s expression, which this one cannot read'}, 'unknown')),
    h('td', {class: 'schedule-paused'}, p ? [
      h('span', {class: 'badge warn'}, 'paused'),
      h('div', {class: 'small'}, 'by ', h('span', {class: 'paused-by'}, p.by || '?'), ' since ' + fmtTime(p.since)),
      p.reason ? h('div', {class: 'small paused-reason'}, p.reason) : h('div', {class: 'small muted'}, 'no reason given'),
    ] : h('span', {class: 'badge ok'}, 'ticking')),
    h('td', null, h('button', {type: 'button', class: op === 'pause' ? 'danger' : 'primary', title: OPS[op].help,
      dataset: {op, definition: s.definition}, onclick: () => open(s.definition, op)}, OPS[op].label)));
}

// schedulePanel holds the form of the chosen pause or resume. As the
// saga repairs do, the form keeps its Idempotency-Key while its request
// is unchanged, so sending again after no answer is the same intent; a
// success, or an edit, makes the next send a new one.
function schedulePanel(reload) {
  const form = h('form', {id: 'schedule-form', class: 'repair-form', hidden: true});
  const result = h('div', {id: 'schedule-result', 'aria-live': 'polite'});
  const el = h('section', {class: 'card', id: 'schedule-panel', hidden: true}, h('h2', null, 'Pause or resume a schedule'), form, result);

  function close() {
    form.hidden = true;
    form.onsubmit = null;
  }

  function open(definition, op) {
    const o = OPS[op];
    const current = {key: newKey('schedule-' + op)};
    const keyLine = h('span', {class: 'mono small', id: 'schedule-key'}, current.key);
    const edited = () => { current.key = newKey('schedule-' + op); keyLine.textContent = current.key; };
    const reason = h('input', {type: 'text', id: 'schedule-reason', size: 50, placeholder: 'why (recorded with the ' + op + ')', oninput: edited});
    form.replaceChildren(
      h('p', null, h('b', null, op === 'pause' ? 'Pause' : 'Resume'), ' the schedule of ', h('span', {class: 'mono', id: 'schedule-definition'}, definition)),
      h('p', {class: 'muted'}, o.help),
      h('label', null, 'Reason ', reason),
      h('div', {class: 'row'},
        h('button', {type: 'submit', id: 'schedule-send', class: op === 'pause' ? 'danger' : 'primary'}, 'Send ' + op),
        h('button', {type: 'button', class: 'link', onclick: () => { close(); el.hidden = true; }}, 'cancel'),
        h('span', {class: 'muted small'}, 'Idempotency-Key ', keyLine)));
    form.onsubmit = async ev => {
      ev.preventDefault();
      const why = reason.value.trim();
      const send = form.querySelector('#schedule-send');
      send.disabled = true;
      result.replaceChildren(h('p', {class: 'muted'}, 'Sending ' + op + '…'));
      try {
        const {data, replayed} = await api('POST', 'v1/schedules/' + encodeURIComponent(definition) + '/' + op,
          {key: current.key, body: why ? {reason: why} : undefined});
        result.replaceChildren(h('div', {class: 'success', id: 'schedule-ok', role: 'status'},
          'The schedule of ', data.definition, (replayed ? ' was already ' : ' is now ') + (op === 'pause' ? 'paused' : 'resumed') +
          (replayed ? ' with this key (replayed)' : '') + ' · ' + fmtTime(data.at)));
        close();
        reload();
      } catch (e) {
        const again = e.status === 0 || e.status >= 500 || (e.status === 409 && e.retryAfter);
        result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'schedule-error'}, problemText(e),
          again ? h('div', {class: 'small'}, 'Sending again uses the same Idempotency-Key, so the ' + op + ' happens at most once.') : null));
      } finally {
        send.disabled = false;
      }
    };
    el.hidden = false;
    form.hidden = false;
    result.replaceChildren();
    reason.focus();
  }

  return {el, open};
}
