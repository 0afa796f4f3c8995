// The status view: /metrics read every POLL_MS, the server's state as numbers and as live charts (uPlot,
// vendor/uPlot.iife.min.js) over the last HISTORY_S seconds since the page opened.

import { apiFetch, errorFrom } from "./api.js";

const POLL_MS = 2000;
const HISTORY_S = 300;

// NOTE(ui): ortserve's own names first; the vLLM names (issue 26) where ortserve has none of its own. KV use
// is vLLM's token fraction where the server exports it, else the share of KV slots in use.
const RUNNING = ["ortserve_requests_running", "vllm:num_requests_running"];
const WAITING = ["ortserve_requests_waiting", "vllm:num_requests_waiting"];
const KV_FRACTION = ["vllm:kv_cache_usage_perc"];
// Generated tokens so far, all requests: every token is one observation of time-to-first-token (a
// request's first) or of inter-token latency (the others), counted while a request runs, not at its end.
const TOKEN_COUNTS = [
  ["ortserve_time_to_first_token_seconds_count", "ortserve_inter_token_latency_seconds_count"],
  ["vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"],
];

/** The samples of a Prometheus text exposition without labels, as {name: value} (labelled ones summed). */
export function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const value = Number(match[3]);
    values[match[1]] = (values[match[1]] ?? 0) + value;
  }
  return values;
}

function first(values, names) {
  for (const name of names) if (name in values) return values[name];
  return null;
}

/** One reading: running, waiting, KV use in % (null when unknown), generated tokens so far. */
export function reading(values) {
  // NOTE(ui): every series carries model_name (one per loaded model of a hub); parseMetrics sums them, so the KV
  // fraction is the summed tokens over the summed capacity, not a sum of per-model fractions.
  let kv = values.ortserve_kv_cache_capacity_tokens > 0
    ? values.ortserve_kv_cache_used_tokens / values.ortserve_kv_cache_capacity_tokens : first(values, KV_FRACTION);
  let kvLabel = "KV cache (tokens)";
  if (kv === null && "ortserve_kv_slots_free" in values && values.ortserve_kv_slots_total > 0) {
    kv = 1 - values.ortserve_kv_slots_free / values.ortserve_kv_slots_total;
    kvLabel = "KV slots in use";
  }
  let tokens = null;
  for (const pair of TOKEN_COUNTS) {
    if (pair.every((name) => name in values)) {
      tokens = pair.reduce((sum, name) => sum + values[name], 0);
      break;
    }
  }
  return {
    running: first(values, RUNNING), waiting: first(values, WAITING),
    kvPercent: kv === null ? null : 100 * kv, kvLabel, tokens,
  };
}

function chartOptions(title, width, series, axes) {
  return {
    title, width, height: 190,
    scales: { x: { time: true }, pct: { range: [0, 100] } },
    series: [{}, ...series],
    axes: [{}, ...axes],
    legend: { live: false },
    cursor: { drag: { x: false, y: false } },
  };
}

export class Status {
  /** @param {object} ui elements: running, waiting, kv, kvLabel, tps, requestsChart, speedChart, error */
  constructor(ui) {
    this.ui = ui;
    this.samples = { t: [], running: [], waiting: [], kv: [], tps: [] };
    this.last = null;
    this.charts = null;
    this.timer = null;
  }

  start() {
    this.poll();
    this.timer = setInterval(() => this.poll(), POLL_MS);
  }

  async poll() {
    let values;
    try {
      const response = await apiFetch("/metrics");
      if (!response.ok) throw await errorFrom(response);
      values = parseMetrics(await response.text());
      this.ui.error.hidden = true;
    } catch (err) {
      this.ui.error.hidden = false;
      this.ui.error.textContent = `Cannot read /metrics: ${err.describe ? err.describe() : err.message}`;
      return;
    }
    this.add(Date.now() / 1000, reading(values));
  }

  add(nowS, now) {
    // Decode speed between two readings: generated tokens over the seconds between them.
    let tps = null;
    if (this.last && now.tokens !== null && this.last.tokens !== null && nowS > this.last.t) {
      tps = Math.max(0, now.tokens - this.last.tokens) / (nowS - this.last.t);
    }
    this.last = { t: nowS, tokens: now.tokens };
    const s = this.samples;
    s.t.push(nowS);
    s.running.push(now.running);
    s.waiting.push(now.waiting);
    s.kv.push(now.kvPercent);
    s.tps.push(tps);
    while (s.t.length && s.t[0] < nowS - HISTORY_S) for (const key in s) s[key].shift();
    this.showNumbers(now, tps);
    this.draw();
  }

  showNumbers(now, tps) {
    const show = (node, value, text) => {
      node.textContent = value === null ? "—" : text;
      node.dataset.value = value === null ? "" : String(value);
    };
    show(this.ui.running, now.running, String(now.running));
    show(this.ui.waiting, now.waiting, String(now.waiting));
    show(this.ui.kv, now.kvPercent, `${now.kvPercent?.toFixed(1)} %`);
    this.ui.kvLabel.textContent = now.kvLabel;
    show(this.ui.tps, tps, `${tps?.toFixed(1)}`);
    this.ui.requestsChart.dataset.samples = String(this.samples.t.length);
  }

  draw() {
    const { uPlot } = globalThis;
    const s = this.samples;
    if (!this.charts) {
      // NOTE(ui): a hidden view has no width; charts are made the first time the view is shown.
      const width = this.ui.requestsChart.clientWidth;
      if (!width) return;
      this.charts = [
        new uPlot(chartOptions("Requests", width, [
          { label: "running", stroke: "#2f6fdf", width: 2 },
          { label: "waiting", stroke: "#d9822b", width: 2 },
        ], [{ label: "requests" }]), [s.t, s.running, s.waiting], this.ui.requestsChart),
        new uPlot(chartOptions("Decode and KV cache", width, [
          { label: "decode tok/s", stroke: "#1a9c5b", width: 2, scale: "y" },
          { label: "KV use %", stroke: "#8e44ad", width: 2, scale: "pct" },
        ], [{ label: "tok/s", scale: "y" }, { label: "KV %", scale: "pct", side: 1, grid: { show: false } }]),
        [s.t, s.tps, s.kv], this.ui.speedChart),
      ];
      return;
    }
    this.charts[0].setData([s.t, s.running, s.waiting]);
    this.charts[1].setData([s.t, s.tps, s.kv]);
  }

  /** The view was shown or resized: fit the charts to it. */
  resize() {
    if (!this.charts) {
      this.draw();
      return;
    }
    const width = this.ui.requestsChart.clientWidth;
    if (width) for (const chart of this.charts) chart.setSize({ width, height: 190 });
  }
}
