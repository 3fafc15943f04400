// siteboot's status page: follows /status/events (server-sent events) and draws the site's
// hosts with their boot timelines. Every string from the server is put into the page with
// textContent or as an attribute value, never parsed as HTML: host names and step details
// can be chosen by machines on the provisioning segment.
'use strict';

(function () {
  const PHASES = [
    ['dhcp', 'DHCP'],
    ['firmware', 'firmware'],
    ['script', 'iPXE script'],
    ['kernel', 'kernel'],
    ['ramdisk', 'ramdisk'],
    ['download', 'download'],
    ['local-disk', 'local disk'],
    ['report', 'report'],
  ];
  const PHASE_NAMES = new Map(PHASES);
  const COUNTERS = [
    ['dhcp_received', 'DHCP received', count],
    ['dhcp_sent', 'DHCP sent', count],
    ['dhcp_leases', 'leases', count],
    ['tftp_active', 'TFTP active', count],
    ['tftp_completed', 'TFTP done', count],
    ['tftp_failed', 'TFTP failed', count],
    ['http_connections_active', 'HTTP connections', count],
    ['http_requests', 'HTTP requests', count],
    ['http_bytes', 'HTTP sent', bytes],
    ['boot_steps', 'boot steps', count],
  ];
  const ROLES = { leader: 'leader', standby: 'standby', 'only-replica': 'only replica' };
  // Hosts only seen in the timeline (made-up MACs included) kept at most; the oldest go.
  const MAX_UNLISTED = 256;
  // When a stream is refused (too many viewers), try again after this long.
  const RETRY_REFUSED_MS = 10000;

  const hosts = new Map(); // MAC -> { data, row, details }
  const open = new Set(); // MACs whose details are shown
  let filter = '';
  const rows = document.getElementById('rows');

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function count(n) {
    return Number(n).toLocaleString('en');
  }

  function bytes(n) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let value = Number(n);
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return (unit === 0 ? value : value.toFixed(1)) + ' ' + units[unit];
  }

  function duration(ms) {
    if (ms < 1000) return ms + ' ms';
    const s = ms / 1000;
    if (s < 60) return s.toFixed(1) + ' s';
    const m = Math.floor(s / 60);
    if (m < 60) return m + ' min ' + Math.round(s - m * 60) + ' s';
    return Math.floor(m / 60) + ' h ' + (m % 60) + ' min';
  }

  function clock(ms) {
    return new Date(ms).toLocaleTimeString('en-GB');
  }

  function phaseName(phase) {
    return PHASE_NAMES.get(phase) || phase;
  }

  // ----- the header: site, health, counters -----

  function showHealth(health) {
    const role = document.getElementById('role');
    role.dataset.role = health.role;
    role.textContent = ROLES[health.role] || health.role;
    const ready = document.getElementById('ready');
    ready.dataset.ready = String(health.ready);
    ready.textContent = health.ready ? 'ready' : 'not ready: ' + (health.not_ready || '');
    const counters = document.getElementById('counters');
    counters.replaceChildren(
      ...COUNTERS.map(([key, label, format]) => {
        const box = el('div', 'counter');
        box.dataset.counter = key;
        box.append(el('span', 'value', format(health.counters[key] || 0)), el('span', 'label', label));
        return box;
      })
    );
  }

  function setLive(state) {
    const live = document.getElementById('live');
    live.dataset.live = state;
    live.textContent = state;
  }

  // ----- hosts -----

  function sortKey(data) {
    return (data.listed ? '0' : '1') + (data.name || '~') + ' ' + data.mac;
  }

  function matches(data) {
    if (!filter) return true;
    const fields = [data.name, data.mac, data.address, data.state, data.claim];
    return fields.some((f) => f && String(f).toLowerCase().includes(filter));
  }

  function cell(className, text) {
    if (text === null || text === undefined || text === '') return el('td', className + ' none', '—');
    return el('td', className, text);
  }

  function imagingCell(operation) {
    const td = el('td', 'imaging');
    if (!operation) {
      td.classList.add('none');
      td.textContent = '—';
      return td;
    }
    const label = el('span', 'op', operation.kind + (operation.step ? ': ' + operation.step : ''));
    const bar = el('progress');
    // Bytes only once the ramdisk reports them; until then the bar says "under way".
    if (operation.bytes && operation.bytes.total > 0) {
      bar.max = operation.bytes.total;
      bar.value = operation.bytes.done;
      const percent = Math.floor((100 * operation.bytes.done) / operation.bytes.total);
      label.textContent += ' (' + percent + '%, ' + bytes(operation.bytes.done) + ' of ' + bytes(operation.bytes.total) + ')';
    }
    td.append(label, bar);
    return td;
  }

  function span(chart) {
    if (chart.length === 0) return null;
    const start = chart[0].start_ms;
    const end = chart[chart.length - 1].end_ms;
    return { start, end, total: Math.max(end - start, 1) };
  }

  function segmentTitle(segment) {
    return phaseName(segment.phase) + ' · ' + duration(segment.end_ms - segment.start_ms) +
      ' · ' + segment.steps + (segment.steps === 1 ? ' step' : ' steps') +
      (segment.detail ? ' · ' + segment.detail : '');
  }

  function chartCell(chart) {
    const td = el('td', 'timeline');
    const range = span(chart);
    if (!range) {
      td.classList.add('none');
      td.textContent = 'no boot seen';
      return td;
    }
    const bar = el('div', 'chart');
    for (const segment of chart) {
      const seg = el('span', 'seg');
      seg.dataset.phase = segment.phase;
      seg.title = segmentTitle(segment);
      seg.style.flexGrow = String(Math.max(segment.end_ms - segment.start_ms, range.total / 200));
      bar.append(seg);
    }
    td.append(bar, el('div', 'chart-total', 'since ' + clock(range.start) + ' · ' + duration(range.end - range.start)));
    return td;
  }

  function lastStep(data) {
    if (!data.last) return '—';
    return data.last.stage + ' ' + clock(data.last.at_ms) + (data.last.detail ? ' · ' + data.last.detail : '');
  }

  function fillRow(entry) {
    const data = entry.data;
    const state = el('span', 'state', data.state);
    state.dataset.state = data.state;
    const stateCell = el('td', 'state-cell');
    stateCell.append(state);
    const name = cell('name', data.name);
    if (data.name) name.title = data.name;
    entry.row.replaceChildren(
      name,
      cell('mac', data.mac),
      cell('address', data.address),
      stateCell,
      cell('claim', data.claim),
      imagingCell(data.operation),
      chartCell(data.chart || []),
      cell('last', data.last ? lastStep(data) : null)
    );
    entry.row.hidden = !matches(data);
    entry.row.classList.toggle('open', open.has(data.mac));
    if (open.has(data.mac)) fillDetails(entry);
  }

  // The expanded view: one line per phase on the run's time axis, with durations.
  function fillDetails(entry) {
    const chart = entry.data.chart || [];
    const td = el('td');
    td.colSpan = 8;
    const range = span(chart);
    if (!range) {
      td.append(el('div', 'gantt-head', 'No boot steps recorded for this host yet.'));
    } else {
      td.append(el('div', 'gantt-head',
        'Boot timeline from ' + clock(range.start) + ', ' + duration(range.end - range.start) + ' so far'));
      const gantt = el('div', 'gantt');
      for (const segment of chart) {
        const track = el('div', 'track');
        const bar = el('span', 'seg');
        bar.dataset.phase = segment.phase;
        bar.title = segmentTitle(segment);
        bar.style.left = ((100 * (segment.start_ms - range.start)) / range.total) + '%';
        bar.style.width = Math.max((100 * (segment.end_ms - segment.start_ms)) / range.total, 0.4) + '%';
        track.append(bar);
        const row = [
          el('div', 'phase', phaseName(segment.phase)),
          track,
          el('div', 'duration', duration(segment.end_ms - segment.start_ms)),
          el('div', 'detail', segment.detail),
        ];
        row[0].dataset.phase = segment.phase;
        gantt.append(...row);
      }
      td.append(gantt);
    }
    if (!entry.details) {
      entry.details = el('tr', 'details');
      entry.row.after(entry.details);
    }
    entry.details.replaceChildren(td);
    entry.details.hidden = entry.row.hidden;
  }

  function toggle(mac) {
    const entry = hosts.get(mac);
    if (!entry) return;
    if (open.has(mac)) {
      open.delete(mac);
      if (entry.details) entry.details.remove();
      entry.details = null;
      entry.row.classList.remove('open');
    } else {
      open.add(mac);
      entry.row.classList.add('open');
      fillDetails(entry);
    }
  }

  function newEntry(data) {
    const row = el('tr', 'host');
    row.dataset.mac = data.mac;
    row.addEventListener('click', () => toggle(data.mac));
    return { data, row, details: null };
  }

  // Puts a new host's row where the sort order wants it.
  function insert(entry) {
    const key = sortKey(entry.data);
    let before = null;
    for (const other of hosts.values()) {
      if (other !== entry && sortKey(other.data) > key && (!before || sortKey(other.data) < sortKey(before.data))) {
        before = other;
      }
    }
    if (before) rows.insertBefore(entry.row, before.row);
    else rows.append(entry.row);
  }

  function forgetOldestUnlisted() {
    const unlisted = [...hosts.values()].filter((e) => !e.data.listed);
    if (unlisted.length <= MAX_UNLISTED) return;
    unlisted.sort((a, b) => (a.data.last ? a.data.last.at_ms : 0) - (b.data.last ? b.data.last.at_ms : 0));
    for (const entry of unlisted.slice(0, unlisted.length - MAX_UNLISTED)) remove(entry.data.mac);
  }

  function remove(mac) {
    const entry = hosts.get(mac);
    if (!entry) return;
    entry.row.remove();
    if (entry.details) entry.details.remove();
    hosts.delete(mac);
    open.delete(mac);
  }

  function updateCount() {
    let shown = 0;
    for (const entry of hosts.values()) if (!entry.row.hidden) shown += 1;
    document.getElementById('count').textContent =
      (filter ? shown + ' of ' : '') + hosts.size + (hosts.size === 1 ? ' host' : ' hosts');
  }

  // ----- the event stream -----

  function onSnapshot(snapshot) {
    document.getElementById('site').textContent = snapshot.site;
    document.title = 'siteboot · ' + snapshot.site;
    showHealth(snapshot.health);
    for (const entry of hosts.values()) {
      entry.row.remove();
      if (entry.details) entry.details.remove();
    }
    hosts.clear();
    const entries = snapshot.hosts.map(newEntry);
    entries.sort((a, b) => (sortKey(a.data) < sortKey(b.data) ? -1 : 1));
    const fragment = document.createDocumentFragment();
    for (const entry of entries) {
      hosts.set(entry.data.mac, entry);
      fillRow(entry);
      fragment.append(entry.row);
    }
    rows.replaceChildren(fragment);
    for (const mac of open) {
      const entry = hosts.get(mac);
      if (entry) fillDetails(entry);
    }
    const omitted = document.getElementById('omitted');
    omitted.hidden = snapshot.unlisted_omitted === 0;
    omitted.textContent = snapshot.unlisted_omitted + ' more MACs seen in the timeline but not listed are left out.';
    document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1);
    updateCount();
  }

  function onStep(step) {
    let entry = hosts.get(step.mac);
    if (!entry) {
      entry = newEntry({ mac: step.mac, name: null, state: 'not listed', address: null, claim: null, operation: null, listed: false });
      hosts.set(step.mac, entry);
      insert(entry);
      forgetOldestUnlisted();
    }
    entry.data.chart = step.chart;
    entry.data.last = { stage: step.stage, at_ms: step.at_ms, detail: step.detail };
    fillRow(entry);
    document.body.dataset.steps = String(Number(document.body.dataset.steps || 0) + 1);
    updateCount();
  }

  function onHost(host) {
    const entry = hosts.get(host.mac);
    if (entry) {
      const moved = sortKey(entry.data) !== sortKey({ ...host, listed: true });
      Object.assign(entry.data, host, { listed: true });
      fillRow(entry);
      if (moved) {
        insert(entry);
        if (entry.details) entry.row.after(entry.details);
      }
    } else {
      const created = newEntry({ ...host, listed: true, chart: [], last: null });
      hosts.set(host.mac, created);
      fillRow(created);
      insert(created);
    }
    updateCount();
  }

  function connect() {
    const events = new EventSource('/status/events');
    events.addEventListener('open', () => setLive('live'));
    events.addEventListener('error', () => {
      if (events.readyState === EventSource.CLOSED) {
        // Refused (too many viewers) or not a stream: EventSource gives up; we do not.
        setLive('closed');
        setTimeout(connect, RETRY_REFUSED_MS);
      } else {
        setLive('reconnecting');
      }
    });
    events.addEventListener('snapshot', (e) => onSnapshot(JSON.parse(e.data)));
    events.addEventListener('step', (e) => onStep(JSON.parse(e.data)));
    events.addEventListener('host', (e) => onHost(JSON.parse(e.data)));
    events.addEventListener('gone', (e) => {
      remove(JSON.parse(e.data).mac);
      updateCount();
    });
    events.addEventListener('health', (e) => showHealth(JSON.parse(e.data)));
  }

  function legend() {
    const box = document.getElementById('legend');
    for (const [phase, name] of PHASES) {
      const item = el('span');
      const swatch = el('span', 'swatch');
      swatch.dataset.phase = phase;
      item.append(swatch, document.createTextNode(name));
      box.append(item);
    }
  }

  function applyFilter(e) {
    filter = e.target.value.trim().toLowerCase();
    for (const entry of hosts.values()) {
      entry.row.hidden = !matches(entry.data);
      if (entry.details) entry.details.hidden = entry.row.hidden;
    }
    updateCount();
  }
  const filterBox = document.getElementById('filter');
  filterBox.addEventListener('input', applyFilter);
  filterBox.addEventListener('change', applyFilter);
  legend();
  connect();
})();
