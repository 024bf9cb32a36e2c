// The coordinator's dashboard: polls /api/status once a second and draws it. No libraries, no
// network beyond the coordinator. Names come from volunteers: they are set as text, never as HTML.
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

function token() {
  const match = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
  if (match) {  // from the link: kept for this tab, and out of the address bar
    sessionStorage.setItem("cleave-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("cleave-token") || "";
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    td.textContent = cell;
    tr.appendChild(td);
  }
  return tr;
}

function fill(table, rows) {
  const body = table.querySelector("tbody");
  body.replaceChildren(...rows.map(row));
}

function curve(points) {
  const svg = $("curve");
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  if (points.length < 2) return;
  const steps = points.map((p) => p[0]), losses = points.map((p) => p[1]);
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  const y0 = Math.min(...losses), y1 = Math.max(...losses);
  const sx = (s) => (x1 > x0 ? ((s - x0) / (x1 - x0)) * 580 + 10 : 300);
  const sy = (l) => (y1 > y0 ? 190 - ((l - y0) / (y1 - y0)) * 170 : 100);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
  svg.appendChild(line);
  $("curve-range").textContent = `steps ${fmt(x0, 0)} to ${fmt(x1, 0)}, loss ${fmt(y1, 3)} to ${fmt(y0, 3)}`;
}

function draw(s) {
  const job = s.job || {};
  $("job-name").textContent = job.name || "";
  $("job-state").textContent = job.state || "";
  $("step").textContent = `${fmt(job.step, 0)} / ${fmt(job.steps, 0)}`;
  $("progress").style.width = job.steps ? `${(100 * job.step) / job.steps}%` : "0";
  $("loss").textContent = fmt(job.loss, 4);
  $("tokens").textContent = fmt(job.tokens_per_s, 0);
  const t = s.tiles || {};
  $("tiles").textContent = fmt(t.verified, 0);
  $("tiles-detail").textContent = `${fmt(t.queued, 0)} queued, ${fmt(t.leased, 0)} leased, ${fmt(t.rejected, 0)} rejected`;
  $("share").textContent = job.gemm_share ? `${fmt(100 * job.gemm_share, 1)}%` : "-";
  $("device-count").textContent = fmt(s.connected, 0);
  curve(s.losses || []);
  fill($("leaderboard"), (s.leaderboard || []).map((r, i) => [String(i + 1), r.name, fmt(r.gflop, 1), fmt(r.tiles, 0)]));
  const devices = s.devices;
  $("devices").hidden = !devices;
  $("devices-locked").hidden = !!devices;
  if (devices) {
    fill($("devices"), devices.map((d) => [d.name, d.state, d.device, fmt(d.gflops, 1), fmt(d.down_mbps, 1),
      fmt(d.up_mbps, 1), fmt(d.tiles_done, 0), fmt(d.tiles_rejected, 0),
      d.reliability === undefined ? "-" : `${fmt(100 * d.reliability, 1)}%`]));
  }
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

let timer = null;

async function poll() {
  clearTimeout(timer);
  try {
    const secret = token();
    const reply = await fetch("/api/status", { headers: secret ? { Authorization: `Bearer ${secret}` } : {},
      cache: "no-store" });
    if (reply.status === 401) {
      sessionStorage.removeItem("cleave-token");
      $("devices-locked").firstChild.textContent = "That token is not the operator's. ";
    }
    if (reply.ok || reply.status === 401) draw(await reply.json());
  } catch (err) {
    $("job-state").textContent = "coordinator unreachable";
  }
  timer = setTimeout(poll, POLL_MS);
}

$("token-button").addEventListener("click", () => {
  sessionStorage.setItem("cleave-token", $("token-input").value);
  $("token-input").value = "";
  poll();
});
poll();
