// Bulk repair from the sagas list (POST /v1/repairs): one repair of
// every saga the list's definition and state select, a dry run first,
// then the same request applied. The API selects by definition and state
// only, newest first, at most `limit` sagas a request, and answers a
// cursor for the rest.
import {APIError, api, fmtTime, h, newKey, problemText} from './common.js';

const OPS = [
  {op: 'retry', label: 'retry', help: 'Run the failed step of each saga again under its key (failed, parked, or waiting out a backoff).'},
  {op: 'cancel', label: 'cancel', help: 'Stop each saga and compensate what it completed.', danger: true},
  {op: 'close', label: 'close', help: 'Close each failed or parked saga as handled by hand; nothing runs for it any more.', danger: true},
  {op: 'pause', label: 'pause', help: 'Start no attempt of each saga until it is resumed.'},
  {op: 'resume', label: 'resume', help: 'Let each paused saga run again.'},
];

const LIMIT_DEFAULT = 100;
const LIMIT_MAX = 1000;
const ITEMS_SHOWN = 50;

// bulkPanel is the "Repair these…" form of the list whose filters are f:
// {definition, state, key, only, from, before, order, cursor}. It answers
// {el, toggle}.
export function bulkPanel(f) {
  const el = h('section', {class: 'card', id: 'bulk', hidden: true, 'aria-labelledby': 'bulk-title'});
  const toggle = () => {
    el.hidden = !el.hidden;
    if (!el.hidden) (el.querySelector('#bulk-op') || el.querySelector('button') || el).focus();
  };
  const title = h('h2', {id: 'bulk-title'}, 'Repair these sagas');

  // What the API cannot select by: the list would show one set and the
  // repair touch another.
  const other = [];
  if (f.key) other.push('the key "' + f.key + '"');
  if (f.only) other.push('only ' + f.only.replace('_', ' '));
  if (f.from) other.push('created from ' + fmtTime(f.from));
  if (f.before) other.push('created before ' + fmtTime(f.before));
  if (other.length) {
    const keep = new URLSearchParams();
    if (f.definition) keep.set('definition', f.definition);
    if (f.state) keep.set('state', f.state);
    el.append(title, h('p', {class: 'error', id: 'bulk-blocked', role: 'note'},
      'The list also filters by ' + other.join(', ') + '. A bulk repair selects sagas by definition and state only, so it would repair a different set than the list shows. Nothing can be sent from here: ',
      (f.definition || f.state) ? h('a', {href: '#/sagas' + (keep.toString() ? '?' + keep : '')}, 'keep only the definition and state filters') : 'choose a definition or a state and clear the other filters',
      ', or repair the sagas one by one from their pages.'));
    return {el, toggle};
  }
  if (!f.definition && !f.state) {
    el.append(title, h('p', {class: 'error', id: 'bulk-blocked', role: 'note'},
      'Choose a definition or a state above first: a bulk repair selects its sagas by definition and state, and needs at least one of them.'));
    return {el, toggle};
  }

  const scope = [f.definition ? 'definition ' + f.definition : 'every definition', f.state ? 'state ' + f.state : 'every state'].join(', ');
  const opSelect = h('select', {id: 'bulk-op'}, OPS.map(o => h('option', {value: o.op}, o.label)));
  const help = h('p', {class: 'muted small', id: 'bulk-help'});
  const reason = h('input', {type: 'text', id: 'bulk-reason', size: 40, placeholder: 'why (recorded with each repair)'});
  const limit = h('input', {type: 'number', id: 'bulk-limit', min: 1, max: LIMIT_MAX, step: 1, value: LIMIT_DEFAULT, size: 5});
  const dryBtn = h('button', {type: 'submit', id: 'bulk-dry', class: 'primary'}, 'Dry run');
  const applyBtn = h('button', {type: 'button', id: 'bulk-apply', class: 'danger', hidden: true});
  const keyLine = h('span', {class: 'mono small', id: 'bulk-key'});
  const result = h('div', {id: 'bulk-result', 'aria-live': 'polite'});

  // plan is the request a dry run showed, and the Idempotency-Key it is
  // applied under; an edit drops it, and a dry run makes a new one.
  let plan = null;
  const forget = () => {
    plan = null;
    applyBtn.hidden = true;
    keyLine.textContent = '';
    result.replaceChildren();
  };
  const showHelp = () => {
    const o = OPS.find(x => x.op === opSelect.value);
    help.textContent = o.help + ' The API decides for each saga, and says why when its state does not allow the repair.';
  };
  opSelect.addEventListener('change', () => { showHelp(); forget(); });
  reason.addEventListener('input', forget);
  limit.addEventListener('input', forget);
  showHelp();

  const notes = [
    'Selects the sagas of ' + scope + ', newest first, at most the limit a request (the API\'s default is ' + LIMIT_DEFAULT + ', its most ' + LIMIT_MAX + '); a dry run says when more match.',
  ];
  if (f.order === 'oldest') notes.push('The repair goes newest first, whatever the list\'s order.');
  if (f.cursor) notes.push('It starts from the newest saga that matches, not from the page the list shows.');

  const body = (dryRun, cursor) => {
    const b = {operation: plan.op, filter: {}, limit: plan.limit};
    if (f.definition) b.filter.definition = f.definition;
    if (f.state) b.filter.state = f.state;
    if (cursor) b.cursor = cursor;
    if (plan.reason) b.reason = plan.reason;
    if (dryRun) b.dry_run = true;
    return b;
  };

  // send makes one request of plan (a dry run, or the repair), with btn
  // disabled meanwhile, so a double click sends it once.
  const send = async (btn, dryRun) => {
    btn.disabled = true;
    result.replaceChildren(h('p', {class: 'muted'}, dryRun ? 'Asking what would change…' : 'Repairing…'));
    try {
      const {data} = await api('POST', 'v1/repairs', {key: plan.key, body: body(dryRun, plan.cursor)});
      return data;
    } catch (e) {
      const again = !dryRun && (e.status === 0 || e.status >= 500 || (e.status === 409 && e.retryAfter));
      result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'bulk-error'}, problemText(e),
        again ? h('div', {class: 'small'}, 'Applying again uses the same Idempotency-Key: a saga already repaired by this request is answered from its record, not repaired twice.') :
          h('div', {class: 'small'}, 'Nothing was repaired by this request' + (dryRun ? ' (it was a dry run)' : '') + '. Change what the message names, then run the dry run again.')));
      return null;
    } finally {
      btn.disabled = false;
    }
  };

  const dryRun = async cursor => {
    const n = Number(limit.value);
    if (!Number.isInteger(n) || n < 1 || n > LIMIT_MAX) {
      result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'bulk-error'}, 'The limit must be a whole number from 1 to ' + LIMIT_MAX + '. Nothing was sent.'));
      return;
    }
    plan = {op: opSelect.value, reason: reason.value.trim(), limit: n, cursor: cursor || '', key: newKey('bulk-' + opSelect.value)};
    applyBtn.hidden = true;
    keyLine.textContent = plan.key;
    const asked = plan;
    const data = await send(dryBtn, true);
    if (!data || plan !== asked) return;
    const c = summary(data.items);
    result.replaceChildren(h('div', {class: 'note-box', id: 'bulk-dry-result', role: 'status', dataset: {count: data.items.length, changes: c.ok}},
      h('b', null, 'Dry run: nothing was written. '),
      data.items.length === 0 ? 'No saga matches ' + scope + (plan.cursor ? ' after the previous page.' : '.') :
        data.items.length + (data.items.length === 1 ? ' saga matches' : ' sagas match') + (plan.cursor ? ' on this page' : '') + ': ' +
        c.ok + ' would be repaired, ' + c.refused + ' would be refused (their reasons below).',
      data.next_cursor ? h('div', {id: 'bulk-more'}, 'More sagas match than the limit of ' + plan.limit + ': this request covers these ' + data.items.length +
        ' only. After applying, run the next page.') : null,
      c.ok ? h('div', {class: 'small'}, 'Apply sends the same request without dry_run. It selects the sagas again when it runs, so a saga that changed or started meanwhile may differ from this list; its answer says what was done to each.') : null),
    itemsTable(data.items, true));
    plan.next = data.next_cursor || '';
    if (c.ok) {
      const o = OPS.find(x => x.op === plan.op);
      applyBtn.textContent = 'Apply ' + plan.op + ' to ' + (data.next_cursor ? 'the first ' : '') + data.items.length + (data.items.length === 1 ? ' saga' : ' sagas');
      applyBtn.className = o.danger ? 'danger' : 'primary';
      applyBtn.hidden = false;
    }
  };

  applyBtn.addEventListener('click', async () => {
    if (!plan) return;
    const asked = plan;
    const data = await send(applyBtn, false);
    if (!data || plan !== asked) return;
    const c = summary(data.items);
    applyBtn.hidden = true;
    const next = data.next_cursor;
    result.replaceChildren(h('div', {class: c.refused ? 'note-box' : 'success', id: 'bulk-ok', role: 'status', dataset: {count: data.items.length, changes: c.ok}},
      h('b', null, plan.op + ' applied: '),
      c.ok + (c.ok === 1 ? ' saga' : ' sagas') + ' repaired' + (c.replayed ? ' (' + c.replayed + ' already by this request: replayed)' : '') +
        ', ' + c.refused + ' refused. Idempotency-Key ' + data.key + '.',
      next ? h('div', {id: 'bulk-rest'}, 'More sagas matched than the limit of ' + plan.limit + '; they were not repaired. ',
        h('button', {type: 'button', id: 'bulk-next', onclick: () => dryRun(next)}, 'Dry run the next ' + plan.limit)) : null),
    itemsTable(data.items, false));
  });

  const form = h('form', {class: 'repair-form', id: 'bulk-form', onsubmit: ev => { ev.preventDefault(); dryRun(''); }},
    h('p', {class: 'muted small', id: 'bulk-scope'}, notes.join(' ')),
    h('div', {class: 'filters'},
      h('label', null, 'Repair ', opSelect),
      h('label', null, 'Reason ', reason),
      h('label', null, 'Limit ', limit)),
    help,
    h('p', {class: 'muted small'}, 'Skip is not offered here: it names a step and the result the other system gave, which differ saga by saga. Skip from a saga\'s page.'),
    h('div', {class: 'row'}, h('div', {class: 'buttons'}, dryBtn, applyBtn),
      h('span', {class: 'muted small'}, 'Idempotency-Key ', keyLine)));
  el.append(title, form, result);
  return {el, toggle};
}

function summary(items) {
  const c = {ok: 0, refused: 0, replayed: 0};
  for (const it of items) {
    if (it.problem) c.refused++;
    else c.ok++;
    if (it.replayed) c.replayed++;
  }
  return c;
}

// itemsTable lists the first items of an answer: each saga, its state
// before, and what the repair did (or would do), or why it was refused.
function itemsTable(items, dryRun) {
  if (items.length === 0) return null;
  const shown = items.slice(0, ITEMS_SHOWN);
  return h('div', {class: 'bulk-items'},
    h('table', {class: 'grid', id: 'bulk-items'},
      h('thead', null, h('tr', null, ['Saga', dryRun ? 'State now → after the repair' : 'State before → now'].map(c => h('th', null, c)))),
      h('tbody', null, shown.map(it => h('tr', {dataset: {id: it.id, outcome: it.problem ? 'refused' : 'repaired'}},
        h('td', {class: 'saga-cell'}, h('a', {class: 'mono small', href: '#/saga/' + it.id}, it.id), h('div', {class: 'small muted'}, it.definition)),
        h('td', null, h('span', {class: 'mono'}, it.before, ' → '), it.problem ?
          [h('span', {class: 'badge bad'}, 'refused'), h('div', {class: 'err-cell small'}, problemText(new APIError(it.problem.status, it.problem)))] :
          [h('span', {class: 'mono'}, it.state), it.replayed ? h('span', {class: 'badge muted'}, ' replayed') : null, it.at ? h('div', {class: 'small muted'}, fmtTime(it.at)) : null]))))),
    items.length > shown.length ? h('p', {class: 'muted small'}, 'and ' + (items.length - shown.length) + ' more, not shown.') : null);
}
