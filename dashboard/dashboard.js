// The run's dashboard: polls /api/run (docs/coordinator.md, "The run as JSON") every two seconds and
// redraws the plan, the sites, the charts and the events. Text from the run is only ever set as
// textContent: a site's error message is data, never markup.
'use strict';

const POLL_MS = 2000;
const state = { after: 0, steps: [], drawnPlan: '', failures: 0, runId: undefined };
const errors = [];

function pageError(message) {
  errors.push(String(message));
  const list = document.getElementById('page-errors');
  const li = document.createElement('li');
  li.textContent = String(message);
  list.appendChild(li);
  document.getElementById('page-errors-section').hidden = false;
  document.body.dataset.pageErrors = String(errors.length);
}
window.addEventListener('error', (e) => pageError(e.message || 'error'));
window.addEventListener('unhandledrejection', (e) => pageError('unhandled rejection: ' + e.reason));

function el(tag, attrs, text) {
  const ns = ['svg', 'rect', 'text', 'line', 'g', 'marker', 'path', 'defs', 'title'].includes(tag)
    ? 'http://www.w3.org/2000/svg' : null;
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// Figures may be missing, or null (JSON has no NaN): shown as '-', never thrown on.
const finite = (v) => typeof v === 'number' && Number.isFinite(v);
function fixed(v, digits) { return finite(v) ? v.toFixed(digits) : '-'; }
function fmtBytes(b) {
  if (!finite(b)) return '-';
  if (b >= 1e9) return (b / 1e9).toFixed(2) + ' GB';
  if (b >= 1e6) return (b / 1e6).toFixed(2) + ' MB';
  if (b >= 1e3) return (b / 1e3).toFixed(1) + ' kB';
  return b + ' B';
}
function fmtSec(s) { return fixed(s, 3); }
function fmtFlops(f) { return finite(f) && f > 0 ? (f / 1e9).toFixed(1) + ' GFLOP/s' : '-'; }

// ---- Plan diagram: one box per stage (its sites, ops and compute per micro-batch), an arrow per cut
// with its codec and the measured link between the stages' first sites.
function drawPlan(run) {
  const plan = run.plan;
  const key = JSON.stringify(plan) + JSON.stringify(run.links);
  if (key === state.drawnPlan) return;
  state.drawnPlan = key;
  const box = document.getElementById('plan-diagram');
  box.replaceChildren();
  if (!plan || !plan.stages) {
    box.appendChild(el('p', { class: 'empty' }, 'Not planned yet: the sites are joining or being measured.'));
    return;
  }
  const stages = plan.stages;
  let slowest = 0;
  stages.forEach((s, k) => { if (s.compute_seconds > stages[slowest].compute_seconds) slowest = k; });
  const W = 230, H = 118, GAP = 150, PAD = 10;
  const width = PAD * 2 + stages.length * W + (stages.length - 1) * GAP;
  const svg = el('svg', { viewBox: `0 0 ${width} ${H + 2 * PAD}`, role: 'img', 'aria-label': 'plan' });
  const defs = el('defs');
  const marker = el('marker', { id: 'arrow', viewBox: '0 0 10 10', refX: '9', refY: '5', markerWidth: '7',
                                markerHeight: '7', orient: 'auto-start-reverse' });
  marker.appendChild(el('path', { d: 'M 0 0 L 10 5 L 0 10 z', fill: '#5b7bb2' }));
  defs.appendChild(marker);
  svg.appendChild(defs);
  stages.forEach((s, k) => {
    const x = PAD + k * (W + GAP), y = PAD;
    const g = el('g', { class: 'stage-box' + (k === slowest && stages.length > 0 ? ' bottleneck' : ''),
                        'data-stage': String(k), 'data-sites': s.sites.join(',') });
    g.appendChild(el('rect', { x, y, width: W, height: H, rx: 6 }));
    // Stages are numbered from 1, as the planner's table and the site logs number them.
    g.appendChild(el('text', { x: x + 10, y: y + 20, class: 'title' }, `stage ${k + 1}: ${s.sites[0]}`));
    const lines = [
      s.first_op === s.last_op ? `op ${s.first_op} (${s.first_op_name})`
        : `ops ${s.first_op}-${s.last_op} (${s.first_op_name} … ${s.last_op_name})`,
      s.sites.length > 1 ? `replicas: ${s.sites.slice(1).join(', ')}` : 'no replicas',
      `compute ${fixed(s.compute_seconds * 1e3, 1)} ms / micro-batch`,
      `in flight ${s.in_flight}` + (k === slowest ? '  — bottleneck' : ''),
    ];
    lines.forEach((t, i) => g.appendChild(el('text', { x: x + 10, y: y + 42 + 18 * i }, t)));
    g.appendChild(el('title', {}, `stage ${k + 1} at ${s.sites.join(', ')}`));
    svg.appendChild(g);
  });
  (plan.links || []).forEach((l) => {
    const from = l.from_stage, to = l.to_stage;
    if (from === undefined || to === undefined || !stages[from] || !stages[to]) return;
    const x1 = PAD + from * (W + GAP) + W, x2 = PAD + to * (W + GAP), y = PAD + H / 2;
    const a = stages[from].sites[0], b = stages[to].sites[0];
    const m = (run.links || []).find((x) => x.from === a && x.to === b);
    const g = el('g', { class: 'link-arrow', 'data-from': String(from), 'data-to': String(to) });
    g.appendChild(el('line', { x1: x1 + 4, y1: y, x2: x2 - 4, y2: y, 'marker-end': 'url(#arrow)' }));
    const mid = (x1 + x2) / 2;
    g.appendChild(el('text', { x: mid, y: y - 26, 'text-anchor': 'middle' }, `codec ${l.codec}`));
    if (m) {
      g.appendChild(el('text', { x: mid, y: y - 10, 'text-anchor': 'middle' },
                       `${fixed(m.bandwidth_bytes_per_second * 8 / 1e6, 1)} Mbit/s`));
      g.appendChild(el('text', { x: mid, y: y + 18, 'text-anchor': 'middle' },
                       `RTT ${fixed(m.latency_seconds * 2e3, 1)} ms`));
    }
    g.appendChild(el('text', { x: mid, y: y + 34, 'text-anchor': 'middle' },
                     `${fixed(l.seconds * 1e3, 1)} ms / micro-batch`));
    svg.appendChild(g);
  });
  box.appendChild(svg);
  const sync = plan.sync && plan.sync.mode === 'diloco'
    ? `; replicas are DiLoCo workers (sync every ${plan.sync.inner_steps} steps)` : '';
  document.getElementById('plan-bottleneck').textContent =
    `${plan.method} plan, predicted ${fixed(plan.predicted_step_seconds, 3)} s/step; bottleneck: ${plan.bottleneck}${sync}`;
}

// ---- Sites table.
function drawSites(run) {
  const body = document.querySelector('#sites tbody');
  body.replaceChildren();
  for (const s of run.sites) {
    const state = s.registered && !s.answering ? 'lost' : s.state;
    const tr = el('tr', { 'data-site': s.name, 'data-state': state });
    const m = s.metrics || {};
    const badge = el('span', { class: 'state ' + state.replace(/[^a-z]/g, '') }, state);
    const cells = [
      s.name, badge,
      !finite(s.heartbeat_age_seconds) || s.heartbeat_age_seconds < 0 ? '-' : s.heartbeat_age_seconds.toFixed(1) + ' s ago',
      String(s.step), s.stage < 0 ? '-' : String(s.stage + 1),
      fmtSec(m.compute_seconds), fmtSec(m.wait_seconds), fmtSec(m.send_blocked_seconds), fmtSec(m.codec_seconds),
      fmtBytes(m.sent_bytes), fmtBytes(m.uncompressed_bytes), s.device || '-', fmtFlops(s.gemm_flops_per_second),
    ];
    for (const c of cells) {
      const td = el('td');
      if (typeof c === 'string') td.textContent = c; else td.appendChild(c);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

// ---- Charts.
const charts = {};
function makeChart(id, datasets, yTitle) {
  const canvas = document.getElementById(id);
  charts[id] = new Chart(canvas, {
    type: 'line',
    data: { datasets: datasets.map((d) => Object.assign({ data: [], pointRadius: 1.5, borderWidth: 1.5, tension: 0 }, d)) },
    options: {
      animation: false, maintainAspectRatio: false, parsing: false, normalized: true,
      scales: { x: { type: 'linear', title: { display: true, text: 'step' } },
                y: { title: { display: true, text: yTitle } } },
      plugins: { legend: { display: datasets.length > 1 } },
    },
  });
}
function setupCharts() {
  makeChart('loss-chart', [{ label: 'loss', borderColor: '#27487d' }], 'loss');
  makeChart('tps-chart', [
    { label: 'measured', borderColor: '#1d6b2f' },
    { label: 'predicted', borderColor: '#c98a16', borderDash: [6, 4], pointRadius: 0 },
    { label: 'compute bound', borderColor: '#a8321f', borderDash: [2, 3], pointRadius: 0 },
  ], 'tokens/s');
  makeChart('wan-chart', [
    { label: 'sent (compressed)', borderColor: '#27487d' },
    { label: 'uncompressed', borderColor: '#9fb3d1' },
  ], 'bytes');
}

// A step's WAN bytes: metrics lines carry each attempt's running totals.
function wanDeltas(steps) {
  const out = [];
  for (let i = 0; i < steps.length; ++i) {
    const s = steps[i], p = steps[i - 1];
    const same = p && p.attempt === s.attempt && p.step < s.step;
    out.push({ step: s.step, wire: s.wire_bytes - (same ? p.wire_bytes : 0),
               raw: s.raw_bytes - (same ? p.raw_bytes : 0) });
  }
  return out;
}

function drawCharts(run) {
  const steps = state.steps;
  const tps = run.run.tokens_per_step || 0;
  const loss = charts['loss-chart'], t = charts['tps-chart'], w = charts['wan-chart'];
  loss.data.datasets[0].data = steps.map((s) => ({ x: s.step, y: s.loss }));
  t.data.datasets[0].data = steps.map((s) => ({ x: s.step, y: s.step_seconds > 0 ? tps / s.step_seconds : 0 }));
  const first = steps.length ? steps[0].step : 1, last = steps.length ? steps[steps.length - 1].step : 1;
  const flat = (v) => (v ? [{ x: first, y: v }, { x: last, y: v }] : []);
  t.data.datasets[1].data = flat(run.run.predicted_tokens_per_second);
  t.data.datasets[2].data = flat(run.run.compute_bound_tokens_per_second);
  const d = wanDeltas(steps);
  w.data.datasets[0].data = d.map((x) => ({ x: x.step, y: x.wire }));
  w.data.datasets[1].data = d.map((x) => ({ x: x.step, y: x.raw }));
  // Points are drawn while they can be told apart; beyond that, the line alone.
  const radius = steps.length > 150 ? 0 : 2;
  for (const c of [loss, t, w]) {
    c.data.datasets.forEach((ds, i) => { if (i === 0 || c !== t) ds.pointRadius = radius; });
    c.update('none');
  }
  for (const [id, c] of Object.entries(charts))
    document.getElementById(id).dataset.points = String(c.data.datasets[0].data.length);
}

// ---- Events, newest first.
function drawEvents(run) {
  const list = document.getElementById('events');
  list.replaceChildren();
  for (const e of run.events.slice().reverse()) {
    const li = el('li', { 'data-kind': e.kind });
    li.appendChild(el('span', { class: 'when' }, `${e.time.slice(11, 19)} step ${e.step}`));
    li.appendChild(el('span', { class: 'kind ' + e.kind }, e.kind));
    li.appendChild(document.createTextNode((e.site ? e.site + ': ' : '') + e.text));
    list.appendChild(li);
  }
}

function drawSummary(run) {
  document.getElementById('cluster').textContent = run.cluster;
  document.getElementById('run-id').textContent = run.run_id;
  const p = run.progress, total = run.run.steps;
  document.getElementById('step').textContent = `${p.step} / ${total}`;
  document.getElementById('loss').textContent = p.step > 0 ? fixed(p.loss, 4) : '-';
  const last = state.steps[state.steps.length - 1];
  document.getElementById('tps').textContent =
    last && last.elapsed_seconds > 0 ? fixed(last.tokens / last.elapsed_seconds, 0) : '-';
  document.getElementById('sps').textContent = p.step > 0 ? fixed(p.step_seconds, 3) : '-';
  document.getElementById('eta').textContent = p.step > 0 ? `${fixed(p.step_seconds * (total - p.step), 0)} s` : '-';
  // The steps the coordinator has recorded (its progress counter may be a report ahead of them).
  document.body.dataset.completedSteps = String(last ? last.step : 0);
}

function apply(run) {
  if (run.run_id !== state.runId) {  // another run on this port (the coordinator restarted): start over
    if (state.runId !== undefined) { state.after = 0; state.steps = []; state.drawnPlan = ''; }
    state.runId = run.run_id;
  }
  for (const s of run.steps) {
    // A resumed attempt trains steps again: what it redoes replaces what the abandoned one did.
    while (state.steps.length && state.steps[state.steps.length - 1].step >= s.step) state.steps.pop();
    state.steps.push(s);
    state.after = Math.max(state.after, s.seq);
  }
  drawSummary(run);
  drawPlan(run);
  drawSites(run);
  drawCharts(run);
  drawEvents(run);
  document.body.dataset.updated = String(Date.now());
}

async function poll() {
  const conn = document.getElementById('connection');
  let run = null;
  try {
    const r = await fetch(`/api/run?after=${state.after}`, { cache: 'no-store' });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    run = await r.json();
    conn.textContent = 'live';
    conn.className = 'fact';
    state.failures = 0;
  } catch (e) {
    // The run ended (the coordinator is gone) or the network blinked: say so, keep the last picture.
    ++state.failures;
    conn.textContent = `coordinator not answering (${e.message})`;
    conn.className = 'fact lost';
  }
  if (run) {
    try {
      apply(run);
    } catch (e) {  // the page's own fault, not the network's: shown as such
      pageError(`drawing the run: ${e.message}`);
    }
  }
  setTimeout(poll, POLL_MS);
}

setupCharts();
poll();
