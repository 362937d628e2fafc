// The dashboard page served at `/`: one self-contained HTML document (no
// CDN: a cluster's network may reach nothing else). It polls /api/status
// every second and draws nodes, actors and, per TrainJob, a chart of
// throughput and world size over the job's time with each failure marked
// (svg.job-chart: polyline.throughput, polyline.world-size,
// line.failure-marker; tests and the screenshot look for these).
#include <string>

#include "troupe/runtime/head/http_endpoint.h"

namespace troupe::head {

namespace {

const char* kPage = R"HTML(<!doctype html>
<html><head><meta charset="utf-8"><title>troupe dashboard</title>
<style>
body{font-family:DejaVu Sans,Liberation Sans,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .3em} h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;font-size:.85em;background:#fff} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
th{background:#eee} .ALIVE{color:#0a0} .DEAD{color:#b00} .RESTARTING,.PENDING{color:#c80}
.job{background:#fff;border:1px solid #ddd;padding:.6em;margin-bottom:1em;display:inline-block}
.legend span{margin-right:1.2em;font-size:.85em} #error{color:#b00}
svg text{font-size:11px;fill:#555}
</style></head>
<body>
<h1>troupe</h1><div id="summary">loading…</div><div id="error"></div>
<h2>Jobs</h2><div id="jobs"><i>no TrainJob has reported to this head</i></div>
<h2>Nodes</h2><table id="nodes"></table>
<h2>Actors <small id="actors-shown"></small></h2><table id="actors"></table>
<script>
"use strict";
const W = 720, H = 240, PAD = {l: 60, r: 50, t: 14, b: 30};
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;"})[c]); }
// Job documents come from any client of the cluster: every field is
// escaped, or made a number, before it goes into the page.
function num(v) { const x = +v; return Number.isFinite(x) ? x : 0; }
function bytes(v) { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  for (v = num(v); v >= 1024 && i < u.length - 1; i++) v /= 1024; return v.toFixed(i ? 1 : 0) + " " + u[i]; }
function res(o) { return Object.entries(o || {}).map(([k, v]) => k + "=" +
  (k === "memory" || k === "object_store_memory" ? bytes(v) : String(+num(v).toFixed(3)))).join(" "); }
function table(el, head, rows) {
  el.innerHTML = "<tr>" + head.map(h => "<th>" + h + "</th>").join("") + "</tr>" +
    rows.map(r => "<tr>" + r.join("") + "</tr>").join("");
}
// One job's chart, or what stopped it: the others are drawn all the same.
function drawn(job) {
  try { return chart(job); } catch (e) { return `<i>no chart: ${esc(e.message)}</i>`; }
}
function chart(job) {
  const list = v => Array.isArray(v) ? v : [];
  // The last 600 points, as the reporter keeps: a document any client
  // wrote may hold more than a chart shows (or than a spread's arguments).
  const h = list(job.history).slice(-600).map(list).map(p => [num(p[0]), num(p[1]), num(p[2])]);
  const events = list(job.events).slice(-600).map(e => e || {}).map(e => ({t: num(e.t), kind: e.kind, detail: e.detail}));
  const ns = "http://www.w3.org/2000/svg";
  const most = (from, xs) => xs.reduce((m, v) => v > m ? v : m, from);
  const tMax = most(most(1e-9, h.map(p => p[0])), events.map(e => e.t));
  const rMax = most(1e-9, h.map(p => p[1])) * 1.1;
  const wMax = most(1, h.map(p => p[2])) + 1;
  const x = t => PAD.l + (W - PAD.l - PAD.r) * t / tMax;
  const yr = r => H - PAD.b - (H - PAD.t - PAD.b) * r / rMax;
  const yw = w => H - PAD.b - (H - PAD.t - PAD.b) * w / wMax;
  let s = `<svg xmlns="${ns}" class="job-chart" id="job-chart-${esc(job.name)}" width="${W}" height="${H}">`;
  s += `<rect x="${PAD.l}" y="${PAD.t}" width="${W - PAD.l - PAD.r}" height="${H - PAD.t - PAD.b}" fill="#fcfcff" stroke="#ccc"/>`;
  for (let i = 0; i <= 4; i++) {
    const r = rMax * i / 4, y = yr(r);
    s += `<line x1="${PAD.l}" x2="${W - PAD.r}" y1="${y}" y2="${y}" stroke="#eee"/>`;
    s += `<text x="${PAD.l - 4}" y="${y + 4}" text-anchor="end">${r >= 1000 ? (r / 1000).toFixed(1) + "k" : r.toFixed(0)}</text>`;
  }
  for (let w = 0, by = Math.ceil(wMax / 10); w <= wMax; w += by) s += `<text x="${W - PAD.r + 4}" y="${yw(w) + 4}">${w}</text>`;
  s += `<text x="${W / 2}" y="${H - 6}" text-anchor="middle">seconds since the job started (max ${tMax.toFixed(1)})</text>`;
  const pts = f => h.map(p => x(p[0]).toFixed(1) + "," + f(p).toFixed(1)).join(" ");
  let step = "";
  h.forEach((p, i) => { if (i) step += x(p[0]).toFixed(1) + "," + yw(h[i - 1][2]).toFixed(1) + " ";
                        step += x(p[0]).toFixed(1) + "," + yw(p[2]).toFixed(1) + " "; });
  s += `<polyline class="throughput" fill="none" stroke="#1f77b4" stroke-width="1.5" points="${pts(p => yr(p[1]))}"/>`;
  s += `<polyline class="world-size" fill="none" stroke="#2ca02c" stroke-width="2.5" points="${step}"/>`;
  for (const e of events.filter(e => e.kind === "failure")) {
    s += `<line class="failure-marker" x1="${x(e.t)}" x2="${x(e.t)}" y1="${PAD.t}" y2="${H - PAD.b}" stroke="#d62728" stroke-width="2" stroke-dasharray="4 3"><title>${esc(e.detail)}</title></line>`;
    s += `<text x="${x(e.t) + 3}" y="${PAD.t + 12}" fill="#d62728" style="fill:#d62728">failure</text>`;
  }
  return s + "</svg>";
}
function render(st) {
  const alive = (st.nodes || []).filter(n => n.alive).length;
  const actors = st.actors || [];
  document.getElementById("summary").textContent =
    `${alive} live node(s), ${actors.filter(a => a.state === "ALIVE").length} live actor(s), ` +
    `${(st.jobs || []).length} job(s); ${((st.workers || {}).calls_per_second || 0).toFixed(0)} calls/s, ` +
    `${(((st.workers || {}).stream_bytes_per_second || 0) / 1e6).toFixed(1)} MB/s streamed; ` +
    `head up ${((st.head || {}).uptime_s || 0).toFixed(0)} s`;
  table(document.getElementById("nodes"), ["id", "host", "state", "resources", "used", "idle workers"],
    (st.nodes || []).map(n => [`<td>${n.id}</td>`, `<td>${esc(n.hostname)}</td>`,
      `<td class="${n.alive ? "ALIVE" : "DEAD"}">${n.alive ? "alive" : "dead"}</td>`,
      `<td>${esc(res(n.total))}</td>`, `<td>${esc(res(n.used))}</td>`, `<td>${n.idle_workers ?? ""}</td>`]));
  // Every actor not dead (the newest 1000), then the latest dead ones: churn
  // of short-lived actors never pushes a live one off the table. Task
  // executors their pools let go are routine (the head keeps them apart):
  // a few of them after the other dead, whose ids they would outnumber.
  const routine = a => a.class === "TaskExecutor" && a.death_cause === "killed by request";
  const live = actors.filter(a => a.state !== "DEAD"), dead = actors.filter(a => a.state === "DEAD");
  const shown = live.slice(-1000).reverse().concat(dead.filter(a => !routine(a)).slice(-100).reverse(),
    dead.filter(routine).slice(-10).reverse());
  document.getElementById("actors-shown").textContent = shown.length < actors.length ?
    `(showing ${shown.length} of ${actors.length}: the newest ${Math.min(live.length, 1000)} not dead, then the latest dead)` : "";
  table(document.getElementById("actors"), ["id", "class", "name", "state", "node", "pid", "restarts", "cause"],
    shown.map(a => [`<td>${a.id}</td>`, `<td>${esc(a.class)}</td>`, `<td>${esc(a.name || "")}</td>`,
      `<td class="${esc(a.state)}">${esc(a.state)}</td>`, `<td>${a.node}</td>`, `<td>${a.pid}</td>`,
      `<td>${a.restarts}</td>`, `<td>${esc(a.death_cause || a.pending_reason || "")}</td>`]));
  const jobs = st.jobs || [];
  document.getElementById("jobs").innerHTML = !jobs.length ? "<i>no TrainJob has reported to this head</i>" : jobs.map(j =>
    `<div class="job"><b>${esc(j.name)}</b> — ${esc(j.state)}, step ${num(j.step)}, epoch ${num(j.epoch) + 1}${num(j.epochs) ? '/' + num(j.epochs) : ''}, ` +
    `${num(j.samples_per_s).toFixed(0)} samples/s, loss ${j.loss === null ? "nan" : num(j.loss).toFixed(4)}, ` +
    `${num(j.world_size)} worker(s), ${num(j.recoveries)} recover${num(j.recoveries) === 1 ? "y" : "ies"}<br>` + drawn(j) +
    `<div class="legend"><span style="color:#1f77b4">— samples/s (left)</span>` +
    `<span style="color:#2ca02c">— world size (right)</span><span style="color:#d62728">┆ failure</span></div></div>`).join("");
}
async function poll() {
  try {
    const r = await fetch("/api/status", {credentials: "same-origin"});
    if (!r.ok) throw new Error(r.status + " " + (await r.text()));
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) { document.getElementById("error").textContent = "cannot read /api/status: " + e.message; }
  // The next a second after this one's answer: a slow head is asked once
  // at a time, not once a second whatever it has not answered yet.
  setTimeout(poll, 1000);
}
poll();
</script></body></html>
)HTML";

}  // namespace

const std::string& dashboard_html() {
  static const std::string page(kPage);
  return page;
}

}  // namespace troupe::head
