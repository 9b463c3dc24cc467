// A definition's pause, on the sagas list filtered by it: whether it is
// paused (GET /v1/definitions), and its Pause definition / Resume
// definition (POST /v1/definitions/{definition}/pause|resume).
import {api, append, canRepair, fmtTime, h, newKey, problemText, session} from './common.js';

const OPS = {
  pause: {label: 'Pause definition…', help: 'Hold every saga of this definition, in every worker: no attempt starts until the definition is resumed. Attempts already running finish; new sagas are accepted and wait.'},
  resume: {label: 'Resume definition…', help: 'Lift the pause: the held sagas of this definition are sent on, each at its next attempt.'},
};

// definitionPanel shows definition's pause and its button. refresh reads
// the definitions again; the form keeps its Idempotency-Key while its
// request is unchanged, so sending again after no answer is the same
// intent.
export function definitionPanel(definition, onChange) {
  const status = h('span', {id: 'definition-status'});
  const button = h('button', {type: 'button', id: 'definition-op', hidden: !canRepair()});
  const form = h('form', {id: 'definition-form', class: 'repair-form', hidden: true});
  const result = h('div', {id: 'definition-result', 'aria-live': 'polite'});
  const el = h('div', {class: 'definition-bar', id: 'definition-bar'}, h('div', {class: 'row'}, status, button), form, result);
  let paused = null;
  let open = false;

  const render = () => {
    const d = session.definitions.find(x => x.name === definition);
    if (!d) {
      status.replaceChildren(h('span', {class: 'muted'}, 'The deployment has not recorded a definition named ' + definition + '.'));
      button.hidden = true;
      return;
    }
    paused = d.paused || null;
    el.dataset.paused = paused ? 'true' : 'false';
    status.replaceChildren();
    append(status, paused ?
      [h('span', {class: 'badge warn'}, 'paused'), ' Definition ', h('b', null, definition), ' is paused since ' + fmtTime(paused.since) + ' by ' + (paused.by || '?'),
        paused.reason ? [': ', h('span', {id: 'definition-reason'}, paused.reason)] : ' (no reason given)', '. Its sagas are held.'] :
      [h('span', {class: 'badge ok'}, 'running'), ' Definition ', h('b', null, definition), ' runs.']);
    const op = paused ? 'resume' : 'pause';
    button.hidden = !canRepair();
    button.textContent = OPS[op].label;
    button.title = OPS[op].help;
    button.dataset.op = op;
    button.className = op === 'pause' ? 'danger' : 'primary';
  };

  const refresh = async () => {
    try {
      const {data} = await api('GET', 'v1/definitions');
      session.definitions = data.definitions || [];
    } catch (e) {
      status.replaceChildren(h('span', {class: 'error'}, 'Could not read whether the definition is paused: ' + problemText(e) + '. The page tries again.'));
      return;
    }
    // An open form keeps what it was opened for.
    if (!open) render();
  };

  button.addEventListener('click', () => {
    const op = button.dataset.op;
    open = true;
    const current = {key: newKey('definition-' + op)};
    const keyLine = h('span', {class: 'mono small', id: 'definition-key'}, current.key);
    const reason = h('input', {type: 'text', id: 'definition-reason-input', size: 40, placeholder: 'why (recorded with the ' + op + ')',
      oninput: () => { current.key = newKey('definition-' + op); keyLine.textContent = current.key; }});
    const send = h('button', {type: 'submit', id: 'definition-send', class: op === 'pause' ? 'danger' : 'primary'}, 'Send ' + op);
    const close = () => { form.hidden = true; form.onsubmit = null; open = false; render(); };
    form.replaceChildren(
      h('p', null, h('b', null, op === 'pause' ? 'Pause' : 'Resume'), ' the definition ', h('span', {class: 'mono'}, definition)),
      h('p', {class: 'muted'}, OPS[op].help),
      h('label', null, 'Reason ', reason),
      h('div', {class: 'row'}, send,
        h('button', {type: 'button', class: 'link', onclick: close}, 'cancel'),
        h('span', {class: 'muted small'}, 'Idempotency-Key ', keyLine)));
    form.onsubmit = async ev => {
      ev.preventDefault();
      const why = reason.value.trim();
      send.disabled = true;
      result.replaceChildren(h('p', {class: 'muted'}, 'Sending ' + op + '…'));
      try {
        const {data, replayed} = await api('POST', 'v1/definitions/' + encodeURIComponent(definition) + '/' + op,
          {key: current.key, body: why ? {reason: why} : undefined});
        result.replaceChildren(h('div', {class: 'success', id: 'definition-ok', role: 'status'},
          'Definition ' + data.definition + (replayed ? ' was already ' : ' is now ') + (op === 'pause' ? 'paused' : 'resumed') +
          (replayed ? ' with this key (replayed)' : '') + ': ' + data.sagas + (data.sagas === 1 ? ' running saga ' : ' running sagas ') +
          (op === 'pause' ? 'held' : 'sent on') + ' · ' + fmtTime(data.at)));
        close();
        await refresh();
        if (onChange) onChange();
      } catch (e) {
        const again = e.status === 0 || e.status >= 500 || (e.status === 409 && e.retryAfter);
        result.replaceChildren(h('div', {class: 'error', role: 'alert', id: 'definition-error'}, problemText(e),
          again ? h('div', {class: 'small'}, 'Sending again uses the same Idempotency-Key, so the ' + op + ' happens at most once.') : null));
      } finally {
        send.disabled = false;
      }
    };
    form.hidden = false;
    result.replaceChildren();
    reason.focus();
  });

  render();
  return {el, refresh};
}
