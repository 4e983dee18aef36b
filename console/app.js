// The operator's console: one module per concern, pages chosen by the URL so an alert can
// link straight to a message. Every page asks the admin API; nothing is shown before the
// token has been accepted.

import { api, ApiError, forgetToken, requestId, setToken, token } from '/console/assets/api.js';
import { perMinuteChart } from '/console/assets/chart.js';
import { age, h, iso, show } from '/console/assets/dom.js';

const STATES = ['pending', 'in_flight', 'delivered', 'dead', 'recorded'];
const FILTERS = ['state', 'paymentId', 'transactionId', 'source', 'createdAtFrom', 'createdAtTo'];

function errorBox(err) {
  const text = err instanceof ApiError ? `${err.message} (${err.status} ${err.code})` : String(err);
  return h('p', { class: 'error', role: 'alert', text });
}

function login(message) {
  forgetToken();
  document.getElementById('nav').hidden = true;
  const input = h('input', { type: 'password', id: 'token', name: 'token', autocomplete: 'off', required: true });
  const form = h('form', { id: 'login-form', class: 'card narrow' },
    h('h1', { text: 'Sign in' }),
    h('label', { for: 'token', text: 'Admin token' }), input,
    h('button', { type: 'submit', text: 'Sign in' }),
    message ? h('p', { class: 'error', id: 'login-error', role: 'alert', text: message }) : null);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    setToken(input.value.trim());
    await route();
  });
  show(form);
  input.focus();
}

// The hosts this process's dispatcher holds back (GET /v1/admin/hosts): breaker open or
// throttled, since when, and the queue heads it holds for each.
function heldHosts(hosts) {
  const since = (x) => [x.openSince && `open since ${x.openSince}`,
    x.throttledSince && `throttled since ${x.throttledSince} until ${x.throttledUntil}`].filter(Boolean).join('; ');
  return h('div', { class: 'card', id: 'held-hosts' },
    h('h2', { text: `Hosts held back (${hosts.length})` }),
    hosts.length
      ? h('table', { id: 'held-hosts-table' },
        h('thead', {}, h('tr', {}, ['Host', 'State', 'Since', 'Consecutive failures', 'Waiting'].map((t) => h('th', { text: t })))),
        h('tbody', {}, hosts.map((x) => h('tr', { class: 'held-host', 'data-host': x.host },
          h('td', { text: x.host }),
          h('td', {}, x.state.map((s) => h('span', { class: `badge ${s}`, text: s }))),
          h('td', { text: since(x) }),
          h('td', { class: 'num', text: x.consecutiveFailures }),
          h('td', { class: 'num waiting', text: x.waiting })))))
      : h('p', { class: 'muted', id: 'no-held-hosts', text: 'No host is held back: every breaker is closed and no host asked for a pause.' }),
    h('p', { class: 'muted', text: 'As this process\'s dispatcher sees them (each process keeps its own breakers). Waiting: the messages at the head of their payment\'s queue that it held back for the host and has not let through yet; messages queued behind them are not counted.' }));
}

// The latest provider-side recoveries (GET /v1/admin/recoveries): what each asked the
// provider to resend, what it answered per window, and the source's callbacks counted since,
// new and replayed (the source's ordinary traffic of that period included).
function recentRecoveries(recoveries) {
  const shown = recoveries.slice(0, 10);
  const figure = (n) => (n === null || n === undefined ? '—' : n);
  const windows = (r) => {
    const failed = r.windows.filter((w) => w.state === 'failed');
    const text = `${r.windows.length} × ≤ 7 days` + (failed.length ? `, ${failed.length} failed` : '');
    return h('td', { class: failed.length ? 'fail' : '', title: failed.map((w) => w.error).join('\n'), text });
  };
  return h('div', { class: 'card', id: 'recoveries' },
    h('h2', { text: `Recent recoveries (${recoveries.length})` }),
    shown.length
      ? h('table', { id: 'recoveries-table' },
        h('thead', {}, h('tr', {}, ['Started', 'Source', 'Range', 'Windows', 'Provider totals', 'New', 'Replays', ''].map((t) => h('th', { text: t })))),
        h('tbody', {}, shown.map((r) => h('tr', { class: 'recovery', 'data-id': r.id },
          h('td', { text: r.startedAt }),
          h('td', { text: r.source }),
          h('td', { text: `${r.from} – ${r.to}` }),
          windows(r),
          h('td', { class: 'num', text: r.windows.map((w) => figure(w.total)).join(' + ') + ` = ${r.requested}` }),
          h('td', { class: 'num recovery-new', text: figure(r.new) }),
          h('td', { class: 'num recovery-replays', text: figure(r.replays) }),
          h('td', { class: 'muted', text: r.counting ? `counting until ${r.countUntil}` : 'counted' })))))
      : h('p', { class: 'muted', id: 'no-recoveries', text: 'No recovery in the last 30 days: run `callbackd recover` to ask a provider to resend its callbacks.' }),
    h('p', { class: 'muted', text: 'New and replays: every callback of the source the store counted from the recovery\'s start until its counting window ends, across every process, its ordinary traffic included.' }));
}

async function overview() {
  const [data, held, recovered] = await Promise.all([
    api('/v1/console/overview'), api('/v1/admin/hosts'), api('/v1/admin/recoveries')]);
  const card = (id, label, value, href) => h('a', { class: 'card stat', id, href },
    h('span', { class: 'value', text: value }), h('span', { class: 'label', text: label }));
  const oldest = data.oldestPending;
  const total = (key) => data.perMinute.reduce((n, m) => n + m[key], 0);
  show(h('section', { id: 'overview' },
    h('h1', { text: 'Overview' }),
    h('div', { class: 'stats' },
      card('depth-pending', 'pending', data.depth.pending, '/console/messages?state=pending'),
      card('depth-in-flight', 'in flight', data.depth.inFlight, '/console/messages?state=in_flight'),
      card('depth-dead', 'dead letters', data.depth.dead, '/console/messages?state=dead'),
      card('oldest-age', 'oldest pending', oldest ? age(oldest.ageSeconds) : '—',
        oldest ? `/console/messages/${oldest.id}` : '/console/messages?state=pending')),
    h('div', { class: 'card' },
      h('h2', { text: 'Deliveries and failures per minute, last hour' }),
      h('p', { class: 'legend' },
        h('span', { class: 'key ok', id: 'total-deliveries', text: `deliveries (${total('deliveries')})` }),
        h('span', { class: 'key fail', id: 'total-failures', text: `failures (${total('failures')})` }),
        h('span', { class: 'muted', id: 'total-dead', text: `of which dead-lettered: ${total('dead')}` })),
      perMinuteChart(data.perMinute),
      h('p', { class: 'muted', text: `Attempts made by every process on this store, as the store counted them. As of ${data.now}.` })),
    heldHosts(held.hosts),
    recentRecoveries(recovered.recoveries)));
}

function selectionFromUrl(params) {
  const selection = {};
  for (const name of FILTERS) {
    const value = params.get(name);
    if (value) selection[name] = value;
  }
  return selection;
}

function filterForm(params) {
  const input = (name, label, placeholder) => h('label', {},
    h('span', { text: label }),
    h('input', { name, id: `filter-${name}`, value: params.get(name) ?? '', placeholder }));
  const state = h('select', { name: 'state', id: 'filter-state' },
    h('option', { value: '', text: 'any' }),
    STATES.map((s) => h('option', { value: s, text: s, selected: params.get('state') === s })));
  const form = h('form', { id: 'filter-form', class: 'filters' },
    h('label', {}, h('span', { text: 'State' }), state),
    input('paymentId', 'Payment id'),
    input('transactionId', 'Transaction id'),
    input('source', 'Source'),
    input('createdAtFrom', 'Created from', '2026-11-30T00:00:00-03:00'),
    input('createdAtTo', 'Created to', '2026-11-30T23:59:59-03:00'),
    h('button', { type: 'submit', text: 'Filter' }));
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [name, value] of new FormData(form)) if (value.trim()) next.set(name, value.trim());
    if (params.get('limit')) next.set('limit', params.get('limit'));
    location.assign(`/console/messages${next.size ? '?' + next : ''}`);
  });
  return form;
}

function bulkResend(selection) {
  const result = h('div', { id: 'bulk-result' });
  const start = h('button', { type: 'button', id: 'resend-selection', text: 'Resend this selection…' });
  start.addEventListener('click', async () => {
    try {
      const count = await api('/v1/admin/resend', { method: 'POST', body: { ...selection, dryRun: true } });
      const n = count.wouldResend;
      const confirm = h('button', { type: 'button', id: 'confirm-bulk', class: 'danger', text: `Resend ${n} message${n === 1 ? '' : 's'}` });
      const cancel = h('button', { type: 'button', text: 'Cancel', onclick: () => result.replaceChildren() });
      confirm.addEventListener('click', async () => {
        confirm.disabled = true;
        try {
          const done = await api('/v1/admin/resend', { method: 'POST', body: { ...selection, requestId: requestId() } });
          result.replaceChildren(h('p', { class: 'ok', id: 'bulk-done', text: `Resent ${done.resent} message${done.resent === 1 ? '' : 's'}.${done.more ? ' More match: narrow the selection and repeat.' : ''}` }));
        } catch (err) {
          result.replaceChildren(errorBox(err));
        }
      });
      result.replaceChildren(h('p', { id: 'dry-run-count', text: `${n} message${n === 1 ? '' : 's'} would be resent${count.more ? ' (more match than one request resends)' : ''}.` }), confirm, ' ', cancel);
    } catch (err) {
      if (err instanceof ApiError && err.refused) return login('The server refused the token.');
      result.replaceChildren(errorBox(err));
    }
  });
  return h('div', { class: 'card bulk' }, start, result);
}

function messageRow(m) {
  const subject = m.paymentId ?? (m.transactionId ? `${m.source}/${m.transactionId}` : '');
  return h('tr', { class: `message-row state-${m.state}`, 'data-id': m.id },
    h('td', {}, h('a', { href: `/console/messages/${m.id}`, text: m.id })),
    h('td', { text: m.kind }),
    h('td', {}, h('span', { class: `badge ${m.state}`, text: m.state })),
    h('td', { text: subject }),
    h('td', { text: m.event ?? '' }),
    h('td', { text: m.createdAt }),
    h('td', { class: 'num', text: m.attemptCount }));
}

async function messages() {
  const params = new URLSearchParams(location.search);
  const selection = selectionFromUrl(params);
  const query = new URLSearchParams(selection);
  for (const name of ['limit', 'cursor']) if (params.get(name)) query.set(name, params.get(name));
  const page = await api(`/v1/messages?${query}`);
  const pager = h('p', { class: 'pager' });
  if (params.get('cursor')) {
    const first = new URLSearchParams(params);
    first.delete('cursor');
    pager.append(h('a', { id: 'first-page', href: `/console/messages?${first}`, text: '« First page' }), ' ');
  }
  if (page.nextCursor) {
    const next = new URLSearchParams(params);
    next.set('cursor', page.nextCursor);
    pager.append(h('a', { id: 'next-page', href: `/console/messages?${next}`, text: 'Next page »' }));
  }
  const table = page.messages.length
    ? h('table', { id: 'messages-table' },
      h('thead', {}, h('tr', {}, ['Id', 'Kind', 'State', 'Payment / transaction', 'Event', 'Created', 'Attempts'].map((t) => h('th', { text: t })))),
      h('tbody', {}, page.messages.map(messageRow)))
    : h('p', { id: 'no-messages', class: 'muted', text: 'No message matches.' });
  show(h('section', { id: 'messages' },
    h('h1', { text: selection.state === 'dead' ? 'Dead letters' : 'Messages' }),
    filterForm(params), bulkResend(selection), table, pager));
}

function attemptItem(a) {
  const outcome = a.kind === 'resend'
    ? `resend${a.requestId ? ` (${a.requestId})` : ''}`
    : a.status !== undefined ? `HTTP ${a.status}` : (a.error ?? 'no answer');
  const ok = a.status >= 200 && a.status < 300;
  const cls = a.kind === 'resend' ? 'resend' : ok ? 'ok' : 'fail';
  const r = a.response;
  return h('li', { class: `attempt ${cls}` },
    h('div', { class: 'attempt-head' },
      h('strong', { text: a.kind === 'resend' ? 'Resend' : `Attempt ${a.attempt}` }),
      h('time', { text: iso(a.at) }),
      h('span', { class: 'outcome', text: outcome }),
      a.latencyMs !== undefined ? h('span', { class: 'muted', text: `${a.latencyMs} ms` }) : null),
    r ? h('div', { class: 'answer' },
      h('p', { class: 'muted', text: [r.contentType && `Content-Type: ${r.contentType}`, r.retryAfter && `Retry-After: ${r.retryAfter}`].filter(Boolean).join(' · ') }),
      r.body ? h('pre', { class: 'answer-body', text: r.body })
        : h('p', { class: 'muted', text: r.bodyDropped ? '(body not kept: only the first and the latest 5 rows keep theirs)' : '(empty body)' }),
      r.bodyTruncated ? h('p', { class: 'muted', text: 'First 2 KB kept.' }) : null) : null);
}

async function message(id) {
  const m = await api(`/v1/messages/${encodeURIComponent(id)}`);
  const field = (label, value) => value === undefined || value === null ? null
    : [h('dt', { text: label }), h('dd', { text: String(value) })];
  const result = h('div', { id: 'resend-result' });
  const resend = h('button', { type: 'button', id: 'resend-button', text: 'Resend…' });
  resend.addEventListener('click', () => {
    const confirm = h('button', { type: 'button', id: 'confirm-resend', class: 'danger', text: 'Deliver it again' });
    const cancel = h('button', { type: 'button', text: 'Cancel', onclick: () => result.replaceChildren() });
    confirm.addEventListener('click', async () => {
      confirm.disabled = true;
      const rid = requestId();
      try {
        const done = await api('/v1/admin/resend', { method: 'POST', body: { messageIds: [m.id], requestId: rid } });
        await message(id);
        document.getElementById('resend-result').replaceChildren(h('p', { class: 'ok', id: 'resend-done',
          text: done.resent ? `Resent (request ${rid}).` : 'Not resent: nothing to deliver.' }));
      } catch (err) {
        result.replaceChildren(errorBox(err));
      }
    });
    result.replaceChildren(h('p', { text: 'Deliver this message once more?' }), confirm, ' ', cancel);
  });
  const dropped = m.historyTotal - m.attempts.length;
  show(h('section', { id: 'message', 'data-state': m.state },
    h('h1', {}, h('span', { text: m.id }), ' ', h('span', { class: `badge ${m.state}`, id: 'message-state', text: m.state })),
    h('div', { class: 'card' }, resend, result),
    h('dl', { class: 'card fields' },
      field('Kind', m.kind), field('Source', m.source), field('Payment id', m.paymentId),
      field('Transaction id', m.transactionId), field('Ordering key', m.orderingKey),
      field('Event', m.event), field('Target', m.targetUrl), field('Created', m.createdAt),
      field('Deadline', m.deadline), field('Next attempt', m.nextAttemptAt),
      field('Delivery attempts', m.attemptCount)),
    Object.keys(m.headers ?? {}).length ? h('div', { class: 'card' }, h('h2', { text: 'Headers' }),
      h('table', {}, h('tbody', {}, Object.entries(m.headers).map(([k, v]) => h('tr', {}, h('th', { text: k }), h('td', { text: v })))))) : null,
    h('div', { class: 'card' }, h('h2', { text: 'Body' }), h('pre', { id: 'message-body', text: JSON.stringify(m.body, null, 2) })),
    h('div', { class: 'card' }, h('h2', { text: `Attempts (${m.attemptCount})` }),
      dropped > 0 ? h('p', { class: 'muted', text: `${dropped} older rows are no longer kept (the first and the latest 100 are).` }) : null,
      m.attempts.length ? h('ol', { id: 'attempts', class: 'timeline' }, m.attempts.map(attemptItem))
        : h('p', { class: 'muted', id: 'attempts', text: 'No attempt yet.' }))));
}

async function route() {
  if (!token()) return login();
  document.getElementById('nav').hidden = false;
  const path = location.pathname.replace(/\/+$/, '');
  try {
    if (path === '/console') await overview();
    else if (path === '/console/messages') await messages();
    else if (path.startsWith('/console/messages/')) await message(decodeURIComponent(path.slice('/console/messages/'.length)));
    else show(h('p', { class: 'error', text: 'No such page.' }));
  } catch (err) {
    if (err instanceof ApiError && err.refused) return login('The server refused this token: check it and sign in again.');
    show(errorBox(err));
  }
}

document.getElementById('logout').addEventListener('click', () => {
  forgetToken();
  login();
});
route();
