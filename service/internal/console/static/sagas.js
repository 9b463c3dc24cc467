// The sagas list: filters, counts by state, one page of sagas.
import {NEEDS_PERSON, canRepair, every, fmtAgo, fmtClock, fmtNum, fmtTime, h, inputTime, inputValue, session, show, stateBadge, view, viewGet, zoneLabel} from './common.js';
import {bulkPanel} from './bulk.js';
import {definitionPanel} from './definitions.js';

const LIST_REFRESH_MS = 5000;

function listHash(params) {
  const q = new URLSearchParams();
  for (const k of ['definition', 'state', 'key', 'only', 'order', 'from', 'before', 'cursor']) if (params.get(k)) q.set(k, params.get(k));
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

// listView shows the sagas that match the hash's definition, state and
// cursor, read again every few seconds while the first page is shown.
export function listView(params) {
  const seq = view.seq;
  const definition = params.get('definition') || '';
  const stateFilter = params.get('state') || '';
  const keyFilter = params.get('key') || '';
  const only = params.get('only') || '';
  const order = params.get('order') || '';
  const from = params.get('from') || '';
  const before = params.get('before') || '';
  const cursor = params.get('cursor') || '';
  const filtered = definition || stateFilter || keyFilter || only || from || before;

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
  const onlySelect = h('select', {id: 'filter-only', onchange: () => go({only: onlySelect.value})},
    [['', 'every saga'], ['stuck', 'stuck (no step in flight, or overdue)'], ['paused', 'paused'], ['waiting', 'waiting for a callback or child'], ['dead_lettered', 'with dead-lettered commands']]
      .map(([v, label]) => h('option', {value: v, selected: v === only}, label)));
  const orderSelect = h('select', {id: 'filter-order', onchange: () => go({order: orderSelect.value})},
    h('option', {value: '', selected: !order}, 'newest first'), h('option', {value: 'oldest', selected: order === 'oldest'}, 'oldest first'));
  // Times are typed in the zone the header chose, and sent in UTC.
  const localInput = (id, value, key) => {
    const el = h('input', {type: 'datetime-local', id, step: 1, onchange: () => go({[key]: inputTime(el.value)})});
    if (value) el.value = inputValue(value);
    return el;
  };
  const fromInput = localInput('filter-from', from, 'from');
  const beforeInput = localInput('filter-before', before, 'before');

  // Find: an ID opens its saga, anything else is looked up as a key.
  const find = h('input', {type: 'search', id: 'find', size: 30, placeholder: 'saga ID or idempotency key', value: keyFilter, 'aria-label': 'Find a saga by ID or key'});
  const findForm = h('form', {class: 'filters', id: 'find-form', role: 'search', onsubmit: ev => {
    ev.preventDefault();
    const v = find.value.trim();
    if (/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(v)) location.hash = '#/saga/' + v.toLowerCase();
    else go({key: v});
  }}, h('label', null, 'Find ', find), h('button', {type: 'submit', id: 'find-btn'}, 'Find'));
  const counts = h('div', {id: 'counts', class: 'counts'});
  const table = h('tbody', {id: 'saga-rows'});
  const status = h('div', {id: 'list-status', class: 'muted small'});
  const errors = h('div', {id: 'list-error'});
  const pager = h('div', {class: 'pager'});
  const bulk = bulkPanel({definition, state: stateFilter, key: keyFilter, only, from, before, order, cursor});
  const defPanel = definition ? definitionPanel(definition, () => load()) : null;
  const bulkBtn = h('button', {type: 'button', id: 'bulk-open', title: 'Apply one repair to the sagas of this definition and state, after a dry run', onclick: bulk.toggle, hidden: !canRepair()}, 'Repair these…');

  show(
    h('section', {class: 'card'},
      h('div', {class: 'row'},
        h('h1', null, 'Sagas'),
        h('form', {class: 'filters', onsubmit: ev => ev.preventDefault()},
          h('label', null, 'Definition ', defSelect),
          h('label', null, 'State ', stateSelect),
          h('label', null, 'Only ', onlySelect),
          h('label', null, 'Created from ', fromInput),
          h('label', null, 'before ', beforeInput),
          h('span', {class: 'muted small', id: 'filter-zone'}, 'times in ' + zoneLabel()),
          h('label', null, 'Order ', orderSelect),
          filtered ? h('button', {type: 'button', class: 'link', id: 'filter-clear', onclick: () => go({definition: '', state: '', key: '', only: '', from: '', before: ''})}, 'clear filters') : null),
        findForm),
      counts,
      defPanel ? defPanel.el : null,
      h('div', {class: 'row list-actions'}, bulkBtn)),
    bulk.el,
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
    if (keyFilter) q.set('key', keyFilter);
    if (only) q.set(only, 'true');
    if (order) q.set('order', order);
    if (from) q.set('created_from', from);
    if (before) q.set('created_before', before);
    if (cursor) q.set('cursor', cursor);
    const data = await viewGet('v1/sagas?' + q, seq, errors);
    if (data === null) return;
    if (defPanel) defPanel.refresh();
    renderCounts(counts, data.counts || {}, stateFilter, go, definition);
    table.replaceChildren(...data.sagas.map(sagaRow));
    if (data.sagas.length === 0) {
      table.append(h('tr', null, h('td', {colspan: 7, class: 'muted'}, keyFilter ? 'No saga was started under the key "' + keyFilter + '".' : filtered ? 'No saga matches these filters.' : 'No sagas yet.')));
    }
    pager.replaceChildren(...[
      cursor ? h('a', {href: listHash(new URLSearchParams({definition, state: stateFilter, key: keyFilter, only, order, from, before})), class: 'button'}, order === 'oldest' ? '⇤ oldest' : '⇤ newest') : null,
      data.next_cursor ? h('a', {href: listHash(new URLSearchParams({definition, state: stateFilter, key: keyFilter, only, order, from, before, cursor: data.next_cursor})), class: 'button', id: 'older'}, order === 'oldest' ? 'newer →' : 'older →') : null].filter(Boolean));
    status.textContent = data.sagas.length + ' shown' + (cursor ? '' : ', refreshed every ' + LIST_REFRESH_MS / 1000 + ' s') + ' · ' + fmtClock(new Date());
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
  // A row is reached by Tab and opened with Enter, as by a click.
  return h('tr', {class: 'clickable', tabindex: 0, 'aria-label': s.definition + ' ' + s.key + ', ' + s.state, dataset: {id: s.id, state: s.state},
    onclick: ev => { if (ev.target.tagName !== 'A') location.hash = link; },
    onkeydown: ev => { if (ev.key === 'Enter' && ev.target === ev.currentTarget) location.hash = link; }},
    h('td', null, stateBadge(s)),
    h('td', null, s.definition),
    h('td', {class: 'mono'}, s.key),
    h('td', {class: 'mono small'}, h('a', {href: link}, s.id)),
    h('td', {class: 'err-cell', title: s.error || ''}, s.error ? h('div', {class: 'clamp'}, s.error) : ''),
    h('td', {title: fmtTime(s.created_at)}, fmtAgo(s.created_at)),
    h('td', {title: fmtTime(s.updated_at)}, fmtAgo(s.updated_at)));
}
