// The event dead letters (GET /v1/event-dead-letters): the messages of a
// definition's events (saga.WithEvents) that could not start a saga, kept
// with why. Read-only: the fix is the publisher's, and dropping one is the
// CLI's `events drop ID`.
import {every, fmtClock, fmtTime, h, session, show, view, viewGet} from './common.js';

const EVENTS_REFRESH_MS = 5000;

// eventsView lists the event dead letters, oldest first, of every
// definition or of the hash's one.
export function eventsView(params) {
  const seq = view.seq;
  const definition = params.get('definition') || '';
  const rows = h('tbody', {id: 'event-dead-letter-rows'});
  const errors = h('div', {id: 'events-error'});
  const status = h('div', {id: 'events-status', class: 'muted small'});
  const defSelect = h('select', {id: 'events-definition', onchange: () => {
    location.hash = '#/events' + (defSelect.value ? '?definition=' + encodeURIComponent(defSelect.value) : '');
  }},
  h('option', {value: ''}, 'every definition'),
  session.definitions.map(d => h('option', {value: d.name, selected: d.name === definition}, d.name)));
  show(
    h('section', {class: 'card'},
      h('div', {class: 'row'},
        h('h1', null, 'Event dead letters'),
        h('form', {class: 'filters', onsubmit: ev => ev.preventDefault()}, h('label', null, 'Definition ', defSelect))),
      h('p', {class: 'muted'}, 'Messages that could not start a saga: without their key header, with a key or a body the input rules refuse, or with the key of a saga started with another body. ' +
        'They were acknowledged and are not delivered again. Fix the publisher and publish each again, then drop it with the CLI (events drop ID).')),
    errors,
    h('section', {class: 'card'},
      h('table', {class: 'grid', id: 'event-dead-letters'},
        h('thead', null, h('tr', null, ['Id', 'Definition', 'Subject', 'Stream', 'Key', 'Reason', 'Deliveries', 'Kept', 'Body'].map(c => h('th', null, c)))),
        rows),
      status));
  let last = '';
  const load = async () => {
    const q = new URLSearchParams({limit: '200'});
    if (definition) q.set('definition', definition);
    const data = await viewGet('v1/event-dead-letters?' + q, seq, errors);
    if (data === null) return;
    const list = data.event_dead_letters;
    status.textContent = list.length + (list.length === 1 ? ' dead letter' : ' dead letters') + ' (oldest first, at most 200)' +
      ', refreshed every ' + EVENTS_REFRESH_MS / 1000 + ' s · ' + fmtClock(new Date());
    const text = JSON.stringify(list);
    if (text === last) return;
    last = text;
    rows.replaceChildren(...list.map(deadLetterRow));
    if (list.length === 0) {
      rows.append(h('tr', null, h('td', {colspan: 9, class: 'muted'}, 'No event dead letter.')));
    }
  };
  load();
  every(EVENTS_REFRESH_MS, load);
}

function deadLetterRow(d) {
  const headers = Object.entries(d.headers || {});
  return h('tr', {dataset: {id: d.id, definition: d.definition}},
    h('td', {class: 'mono'}, d.id),
    h('td', null, d.definition),
    h('td', {class: 'mono small'}, d.subject),
    h('td', {class: 'mono small'}, d.stream + ' #' + d.stream_seq),
    h('td', {class: 'mono small'}, d.key ? d.key : h('span', {class: 'muted'}, 'none')),
    h('td', {class: 'err-cell dead-letter-reason'}, d.reason),
    h('td', null, d.deliveries),
    h('td', {title: 'kept by ' + (d.parked_by || '?')}, fmtTime(d.at)),
    h('td', {class: 'mono small'},
      h('pre', {class: 'json dead-letter-body'}, bodyText(d.body)),
      headers.length ? h('div', {class: 'muted'}, headers.map(([k, v]) => k + ': ' + v).join(' · ')) : null));
}

// bodyText is the message's body as text: the API sends it in base64,
// as JSON does bytes. A body that is not UTF-8 is shown as replacement
// characters; it is never inserted as markup.
function bodyText(b64) {
  if (!b64) return '(empty)';
  try {
    const bin = atob(b64);
    return new TextDecoder().decode(Uint8Array.from(bin, c => c.charCodeAt(0)));
  } catch {
    return b64;
  }
}
