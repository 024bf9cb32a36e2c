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

// Energy in the unit that reads best: J, kJ, MJ; kWh past 3.6 MJ.
function joules(j) {
  if (j >= 3.6e6) return `${fmt(j / 3.6e6, 2)} kWh`;
  if (j >= 1e6) return `${fmt(j / 1e6, 2)} MJ`;
  if (j >= 1e3) return `${fmt(j / 1e3, 1)} kJ`;
  return `${fmt(j, 0)} J`;
}

// Joules by source as shares: "rapl 62%, estimate 38%".
function sources(mix) {
  const entries = Object.entries(mix || {});
  const total = entries.reduce((sum, [, j]) => sum + j, 0);
  if (!total) return "none yet";
  return entries.map(([source, j]) => `${source} ${fmt((100 * j) / total, 0)}%`).join(", ");
}

let rankBy = "gflop";

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

// The loss chart's frame (viewBox units) and smoothing: an exponential moving average, as
// TensorBoard's, debiased at the start so the first points are not pulled towards zero.
const LEFT = 52, RIGHT = 12, TOP = 12, BOTTOM = 30;
const SVG = "http://www.w3.org/2000/svg";

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function ticks(lo, hi, count) {  // round steps (1, 2 or 5 times a power of ten) and their decimals
  if (!(hi > lo)) return { values: [lo], digits: 2 };
  const raw = (hi - lo) / count, p = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
  const values = [];
  const first = Math.ceil(lo / step);
  for (let i = 0; i <= count * 3; i++) {  // bounded: a step below the values' resolution ends too
    const v = (first + i) * step;
    if (v > hi + step * 1e-9) break;
    values.push(+v.toPrecision(12));
  }
  return { values, digits: Math.min(6, Math.max(0, -Math.floor(Math.log10(step)))) };
}

function smoothed(values) {  // over about a tenth of the points shown (0.9 from 30 points on)
  const k = Math.min(0.9, 1 - 3 / Math.max(values.length, 4));
  let avg = 0;
  return values.map((v, i) => { avg = k * avg + (1 - k) * v; return avg / (1 - k ** (i + 1)); });
}

let hoverX = null;  // where the pointer is over the chart (viewBox units), kept across redraws

function curve(all, allHeld) {
  const finite = (p) => Number.isFinite(p[0]) && Number.isFinite(p[1]);  // a diverged loss is null
  const points = all.filter(finite), held = (allHeld || []).filter(finite);  // held-out: steps that evaluated
  const svg = $("curve");
  const empty = points.length === 0;
  svg.hidden = empty;
  $("curve-empty").hidden = !empty;
  $("curve-legend").hidden = empty;
  $("legend-held").hidden = held.length === 0;
  svg.replaceChildren();
  if (empty) { $("curve-range").textContent = ""; return; }
  // One viewBox unit per CSS pixel (within bounds), so the labels read the same on a phone.
  const W = Math.round(Math.max(320, Math.min(960, svg.clientWidth || 640))), H = W < 500 ? 200 : 240;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const steps = points.map((p) => p[0]), losses = points.map((p) => p[1]), smooth = smoothed(losses);
  const heldLosses = held.map((p) => p[1]);
  const x0 = Math.min(...steps, ...held.map((p) => p[0])), x1 = Math.max(x0 + 1, ...steps, ...held.map((p) => p[0]));
  let y0 = Math.min(...losses, ...heldLosses), y1 = Math.max(...losses, ...heldLosses);
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const sx = (s) => LEFT + ((s - x0) / (x1 - x0)) * (W - LEFT - RIGHT);
  const sy = (l) => TOP + (1 - (l - y0) / (y1 - y0)) * (H - TOP - BOTTOM);
  const yTicks = ticks(y0, y1, 5);
  for (const v of yTicks.values) {
    svg.appendChild(el("line", { class: "grid", x1: LEFT, x2: W - RIGHT, y1: sy(v), y2: sy(v) }));
    svg.appendChild(el("text", { x: LEFT - 6, y: sy(v) + 4, "text-anchor": "end" }, fmt(v, yTicks.digits)));
  }
  for (const v of ticks(x0, x1, 6).values.filter((t) => Number.isInteger(t))) {
    svg.appendChild(el("line", { class: "axis", x1: sx(v), x2: sx(v), y1: H - BOTTOM, y2: H - BOTTOM + 4 }));
    svg.appendChild(el("text", { x: sx(v), y: H - BOTTOM + 16, "text-anchor": "middle" }, fmt(v, 0)));
  }
  svg.appendChild(el("line", { class: "axis", x1: LEFT, x2: W - RIGHT, y1: H - BOTTOM, y2: H - BOTTOM }));
  svg.appendChild(el("line", { class: "axis", x1: LEFT, x2: LEFT, y1: TOP, y2: H - BOTTOM }));
  svg.appendChild(el("text", { x: (LEFT + W - RIGHT) / 2, y: H - 2, "text-anchor": "middle" }, "step"));
  svg.appendChild(el("text", { x: 12, y: TOP + (H - TOP - BOTTOM) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${TOP + (H - TOP - BOTTOM) / 2})` }, "loss"));
  const path = (ys) => points.map((p, i) => `${sx(p[0]).toFixed(1)},${sy(ys[i]).toFixed(1)}`).join(" ");
  svg.appendChild(el("polyline", { class: "raw", points: path(losses) }));
  svg.appendChild(el("polyline", { class: "smooth", points: path(smooth) }));
  // The held-out loss: a point at each step that evaluated it, joined by a dashed line.
  if (held.length > 1) {
    svg.appendChild(el("polyline", { class: "held", points: held.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
  }
  for (const p of held) svg.appendChild(el("circle", { class: "held-point", cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 3 }));
  // Hover: the nearest step's loss and its smoothed value.
  const marker = el("circle", { class: "marker", r: 3.5, visibility: "hidden" });
  const label = el("text", { id: "hover-text", x: W - RIGHT, y: TOP + 10, "text-anchor": "end" }, "");
  svg.append(marker, label);
  const show = (x) => {
    let best = 0;
    for (let i = 1; i < points.length; i++) if (Math.abs(sx(steps[i]) - x) < Math.abs(sx(steps[best]) - x)) best = i;
    marker.setAttribute("cx", sx(steps[best]));
    marker.setAttribute("cy", sy(losses[best]));
    marker.setAttribute("visibility", "visible");
    let text = `step ${fmt(steps[best], 0)}: loss ${fmt(losses[best], 4)} (smoothed ${fmt(smooth[best], 4)})`;
    if (held.length) {  // the evaluation nearest the pointer
      let near = 0;
      for (let i = 1; i < held.length; i++) if (Math.abs(sx(held[i][0]) - x) < Math.abs(sx(held[near][0]) - x)) near = i;
      text += `; held-out ${fmt(held[near][1], 4)} at step ${fmt(held[near][0], 0)}`;
    }
    label.textContent = text;
  };
  svg.onmousemove = (event) => {
    const box = svg.getBoundingClientRect();
    hoverX = ((event.clientX - box.left) / box.width) * W;
    show(hoverX);
  };
  svg.onmouseleave = () => { hoverX = null; marker.setAttribute("visibility", "hidden"); label.textContent = ""; };
  if (hoverX !== null) show(hoverX);  // the poll redrew the chart under a still pointer
  const last = losses.length - 1;
  $("curve-range").textContent = `steps ${fmt(steps[0], 0)} to ${fmt(steps[last], 0)}: loss ${fmt(losses[0], 3)} ` +
    `at the first, ${fmt(losses[last], 3)} at the last (lowest ${fmt(Math.min(...losses), 3)})` +
    (held.length ? `; held-out ${fmt(heldLosses[held.length - 1], 3)} at step ${fmt(held[held.length - 1][0], 0)} ` +
      `(lowest ${fmt(Math.min(...heldLosses), 3)})` : "");
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.round(seconds), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h ${String(m).padStart(2, "0")}m` : `${m}m ${String(s % 60).padStart(2, "0")}s`;
}

function reliability(d) {  // never "100.0%" once a tile failed: rounding must not hide a failure
  if (d.reliability === undefined || d.reliability === null) return "-";
  const failed = (d.tiles_rejected || 0) + (d.tiles_lost || 0) + (d.tiles_revoked || 0);
  const share = 100 * d.reliability;
  return `${fmt(failed && share >= 99.95 ? 99.9 : share, 1)}%`;
}

function dashboardLink(url) {  // a rank's websocket URL -> its dashboard's address, as a link
  const a = document.createElement("a");
  const match = /^(wss?):\/\/([^\s/]+)$/.exec(url || "");
  if (!match) { a.textContent = "-"; return a; }
  a.href = `${match[1] === "wss" ? "https" : "http"}://${match[2]}/`;
  a.textContent = a.href;
  a.rel = "noreferrer";
  return a;
}

function drawTier(tier) {
  $("tier-section").hidden = !tier;
  $("job-rank").textContent = tier ? `rank ${tier.rank} of ${tier.world}` : "";
  if (!tier) return;
  const body = $("tier").querySelector("tbody");
  body.replaceChildren(...(tier.ranks || []).map((r) => {
    const tr = row([`${r.rank === tier.rank ? "* " : ""}${r.rank}`, r.health || "-",
      r.step === undefined ? (r.note || "no status yet") : r.state, fmt(r.step, 0), fmt(r.devices, 0),
      fmt(r.tiles_per_s, 1), fmt(r.gflops, 1)]);
    const td = document.createElement("td");
    td.appendChild(dashboardLink(r.url));
    tr.appendChild(td);
    return tr;
  }));
}

function draw(s) {
  const job = s.job || {};
  drawTier(s.tier);
  $("job-name").textContent = job.name || "";
  $("job-state").textContent = job.state || "";
  $("job-state").classList.toggle("finished", job.state === "finished");
  $("step").textContent = `${fmt(job.step, 0)} / ${fmt(job.steps, 0)}`;
  $("timing").textContent = job.elapsed_s === null || job.elapsed_s === undefined ? "not started" :
    `${duration(job.elapsed_s)} elapsed` + (job.eta_s === null || job.eta_s === undefined ? "" :
      `, about ${duration(job.eta_s)} left`);
  $("progress").style.width = job.steps ? `${(100 * job.step) / job.steps}%` : "0";
  $("loss").textContent = fmt(job.loss, 4);
  $("val-loss").textContent = job.val_step === null || job.val_step === undefined ? "" :
    `held-out ${fmt(job.val_loss, 4)} at step ${fmt(job.val_step, 0)}`;
  $("tokens").textContent = fmt(job.tokens_per_s, 0);
  const t = s.tiles || {};
  $("tiles").textContent = fmt(t.verified, 0);
  $("tiles-detail").textContent = `${fmt(t.queued, 0)} queued, ${fmt(t.leased, 0)} leased, ` +
    `${fmt(t.rejected, 0)} rejected, ${fmt(t.lost, 0)} lost`;
  const lost = Object.entries(s.lost_reasons || {});
  $("lost-reasons").hidden = lost.length === 0;
  $("lost-reasons").textContent = lost.length ? "Tiles lost because: " +
    lost.map(([why, n]) => `${why || "no reason given"} (${fmt(n, 0)})`).join(", ") : "";
  $("share").textContent = job.gemm_share ? `${fmt(100 * job.gemm_share, 1)}%` : "-";
  $("device-count").textContent = fmt(s.connected, 0) + (s.standby ? ` (${fmt(s.standby, 0)} in standby)` : "");
  curve(s.losses || [], s.val_losses);
  const e = s.energy || {};
  $("energy").textContent = e.joules ? joules(e.joules) : "-";
  $("energy-detail").textContent = e.joules ? `increment ${joules(e.increment_j || 0)} (over machines on anyway), ` +
    `${fmt(e.j_per_gflop, 3)} J per verified GFLOP, ` +
    `${fmt(e.gco2, 1)} g CO2 at ${fmt(e.grid_gco2_kwh, 0)} g/kWh; devices ${sources(e.devices_sources)}, ` +
    `coordinator ${sources(e.coordinator_sources)}` + (e.flagged ? `; ${fmt(e.flagged, 0)} claims capped` : "") :
    "no energy reported yet";
  const board = (rankBy === "efficiency" ? s.leaderboard_efficiency : s.leaderboard) || [];
  fill($("leaderboard"), board.map((r, i) => [String(i + 1), r.name, fmt(r.gflop, 1), fmt(r.tiles, 0),
    r.joules ? joules(r.joules) : "-", fmt(r.gflop_per_j, 2)]));
  $("leaderboard").hidden = board.length === 0;
  $("leaderboard-empty").hidden = board.length > 0;
  const devices = s.devices;
  $("devices").hidden = !devices;
  $("devices-locked").hidden = !!devices;
  if (devices) {
    fill($("devices"), devices.map((d) => [d.name, d.reason && !["working", "idle"].includes(d.state) ?
      `${d.state} (${d.reason})` : d.state, d.device, fmt(d.gflops, 1), fmt(d.down_mbps, 1),
      fmt(d.up_mbps, 1), fmt(d.tiles_done, 0), fmt(d.tiles_rejected, 0), fmt(d.tiles_lost, 0), reliability(d),
      fmt(d.gflop_verified, 2), d.joules ? joules(d.joules) : "-",
      (d.energy_source || "-") + (d.energy_flagged ? ` (${d.energy_flagged} capped)` : "")]));
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

for (const [id, by] of [["rank-gflop", "gflop"], ["rank-efficiency", "efficiency"]]) {
  $(id).addEventListener("click", () => {
    rankBy = by;
    $("rank-gflop").setAttribute("aria-pressed", String(by === "gflop"));
    $("rank-efficiency").setAttribute("aria-pressed", String(by === "efficiency"));
    poll();
  });
}

$("token-button").addEventListener("click", () => {
  sessionStorage.setItem("cleave-token", $("token-input").value);
  $("token-input").value = "";
  poll();
});
poll();
