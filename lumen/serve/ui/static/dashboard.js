/* The dashboard: GET /dashboard/data about once a second (the next poll starts when the last one ended), drawn
   with uPlot. The data holds counts and timings only, never prompts or outputs; it is shown as text anyway. */
"use strict";

const $ = (id) => document.getElementById(id);
const KEEP_S = 120;                       // seconds of history the time charts keep
const POLL_TIMEOUT_MS = 5000;             // a poll without an answer by then is given up
const series = {t: [], tps: [], running: [], waiting: []};
const charts = {};
let skew = null;                          // the server's clock less this browser's, in s (null: no answer yet)

function fmt(x, digits) { return x == null ? "–" : Number(x).toFixed(digits); }
function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + " %"; }
function triple(p) { return p.count ? `${fmt(p.p50, 1)} / ${fmt(p.p90, 1)} / ${fmt(p.p99, 1)}` : "–"; }

/* the width of the chart's box: its figure's (a phone's screen can be narrower than 300 px) */
function chartWidth(el) { return Math.max(200, el.clientWidth || 420); }

function makeChart(id, seriesOpts, time) {
  const el = $(id);
  const opts = {width: chartWidth(el), height: 180, legend: {show: true},
                scales: {x: {time: time}}, series: [{}, ...seriesOpts],
                axes: [{}, {size: 50}]};
  return new uPlot(opts, [[], ...seriesOpts.map(() => [])], el);
}

function ensureCharts() {
  if (charts.tps || typeof uPlot === "undefined") return;
  charts.tps = makeChart("chart-tps", [{label: "tok/s", stroke: "#2a6fdb", width: 2}], true);
  charts.reqs = makeChart("chart-reqs", [{label: "running", stroke: "#1b9e4b", width: 2},
                                         {label: "waiting", stroke: "#d9480f", width: 2}], true);
  const dots = (label, stroke) => ({label, stroke, points: {show: true, size: 5}, paths: () => null});
  charts.steps = makeChart("chart-steps", [dots("decode tokens", "#2a6fdb"), dots("prefill/mixed tokens", "#d9480f"),
                                           dots("sequences", "#7b2ad9")], true);
  charts.wall = makeChart("chart-wall", [dots("decode", "#2a6fdb"), dots("prefill/mixed", "#d9480f")], true);
}

/* a point of the time charts (nulls: no data, a gap in the lines), the last KEEP_S seconds kept */
function addPoint(t, tps, running, waiting) {
  if (series.t.length && t <= series.t[series.t.length - 1]) return;
  series.t.push(t); series.tps.push(tps); series.running.push(running); series.waiting.push(waiting);
  while (series.t.length && series.t[0] < t - KEEP_S) for (const k in series) series[k].shift();
  if (charts.tps) {
    charts.tps.setData([series.t, series.tps]);
    charts.reqs.setData([series.t, series.running, series.waiting]);
  }
}

/* a column per phase: the value where the step is of that phase, else null (no point) */
function byPhase(recent, decode, key) {
  return recent.map((s) => ((s.phase === "decode") === decode ? s[key] : null));
}

function renderSplit(steps) {
  const body = $("split").querySelector("tbody");
  const rows = [];
  const note = $("split-note");
  if (!steps.available) { note.textContent = "(" + steps.note + ")"; body.replaceChildren(); return; }
  const phases = ["decode", "prefill"].map((k) => steps.split[k]);
  const n = phases.map((p) => (p ? p.steps : 0));
  note.textContent = `(means over the last ${n[0]} decode and ${n[1]} prefill/mixed steps)`;
  const names = [...steps.groups, "unattributed", "step wall"];
  names.forEach((g, i) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = g;
    tr.append(th);
    for (const p of phases) {
      let ms = null;
      if (p) ms = i < steps.groups.length ? p.ms[i] : g === "unattributed" ? p.unattributed_ms : p.wall_ms;
      const td = document.createElement("td");
      td.textContent = fmt(ms, 2);
      const bar = document.createElement("td");
      if (p && g !== "step wall" && p.wall_ms > 0) {
        const b = document.createElement("span");
        b.className = "bar";
        b.style.width = Math.min(100, 100 * ms / p.wall_ms).toFixed(1) + "%";
        bar.append(b);
        bar.title = pct(ms / p.wall_ms);
      }
      tr.append(td, bar);
    }
    rows.push(tr);
  });
  body.replaceChildren(...rows);
}

/* a Ray application's replicas, one row each (d.replicas: absent for one process); another pool's marked */
function renderReplicas(replicas) {
  $("replicas-section").hidden = !replicas;
  if (!replicas) return;
  const rows = replicas.map((r) => {
    const tr = document.createElement("tr");
    const cells = [r.pool ? `${r.replica} (${r.pool})` : r.replica, fmt(r.output_tps, 1), r.running, r.waiting, pct(r.kv_usage) + ` of ${r.kv_blocks}`,
                   pct(r.prefix_hit_rate), triple(r.ttft_ms), triple(r.itl_ms), r.threads, r.generation_tokens];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = String(c);
      tr.append(td);
    }
    return tr;
  });
  $("replicas").querySelector("tbody").replaceChildren(...rows);
}

function render(d) {
  $("model").textContent = d.model;
  $("output_tps").textContent = fmt(d.output_tps, 1);
  $("running").textContent = d.running;
  $("waiting").textContent = d.waiting;
  $("kv_usage").textContent = pct(d.kv_usage) + ` of ${d.kv_blocks} blocks`;
  $("prefix_hit_rate").textContent = pct(d.prefix_hit_rate);
  $("ttft").textContent = triple(d.ttft_ms);
  $("itl").textContent = triple(d.itl_ms);
  $("threads").textContent = `${d.threads} of ${d.threads_max}`;
  $("generation_tokens").textContent = d.generation_tokens;
  $("spec-tile").hidden = !d.speculative;
  if (d.speculative) {
    const s = d.speculative;
    $("spec").textContent = s.acceptance == null ? "– (nothing drafted)" : `${pct(s.acceptance)} of ${s.drafted}`;
  }
  $("window").textContent = `latency percentiles, prefix hits and acceptance over the last ${d.window_s} s ` +
    `(${d.ttft_ms.count} first tokens, ${d.itl_ms.count} inter-token gaps of finished requests)`;
  ensureCharts();
  skew = d.time - Date.now() / 1e3;
  addPoint(d.time, d.output_tps, d.running, d.waiting);
  if (charts.tps) {
    const r = d.steps.recent;
    const t = r.map((s) => s.t);
    charts.steps.setData([t, byPhase(r, true, "tokens"), byPhase(r, false, "tokens"), r.map((s) => s.seqs)]);
    charts.wall.setData([t, byPhase(r, true, "wall_ms"), byPhase(r, false, "wall_ms")]);
  }
  const idle = d.steps.available && !d.steps.recent.length;        // the charts are empty: say why
  for (const e of document.querySelectorAll(".steps-idle")) e.textContent = idle ? " (no step lately: idle)" : "";
  renderSplit(d.steps);
  renderReplicas(d.replicas);
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

/* the status (a live region): set only when its words change, so a screen reader says nothing every second */
function say(text) { if ($("status").textContent !== text) $("status").textContent = text; }

/* One poll, given up after POLL_TIMEOUT_MS: a server that takes the connection but never answers (its process
   frozen, the network gone) is said to be silent, not shown "live" over its last figures. None while the tab is
   hidden: each poll keeps the server's step recording on, and nobody looks. */
let timer = null, inFlight = false;

async function poll() {
  timer = null;
  if (document.hidden) return;                        // polled again when shown
  inFlight = true;
  const ctl = new AbortController();
  const giveUp = setTimeout(() => ctl.abort(), POLL_TIMEOUT_MS);
  try {
    const r = await keyedFetch("/dashboard/data", {cache: "no-store", signal: ctl.signal});
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
    say("live");
    document.body.classList.remove("stale");
  } catch (e) {
    let why = e instanceof TypeError ? `server unreachable (${e.message})` : String(e.message || e);
    if (e.name === "AbortError")
      why = asking ? "waiting for the API key" : `no answer within ${POLL_TIMEOUT_MS / 1000} s`;
    say(`no data: ${why}; trying again every second`);
    document.body.classList.add("stale");                // the figures shown are the last known, greyed
    if (skew != null)                 // the lines break over the time without data, on the server's clock
      addPoint(Date.now() / 1e3 + skew, null, null, null);
  } finally {
    clearTimeout(giveUp);
    inFlight = false;
  }
  timer = setTimeout(poll, 1000);
}

document.addEventListener("visibilitychange", () => {
  if (document.hidden || inFlight) return;
  if (skew != null) addPoint(Date.now() / 1e3 + skew, null, null, null);   // no line across the hidden time
  clearTimeout(timer);
  poll();
});

window.addEventListener("resize", () => {
  for (const [name, chart] of Object.entries(charts)) {
    const el = $("chart-" + name);
    chart.setSize({width: chartWidth(el), height: 180});
  }
});

poll();
