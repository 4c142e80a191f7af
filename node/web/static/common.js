"use strict";
// Shared helpers of the intellect-node pages. Every value from the server is put in the DOM as
// text (never as HTML): peer IDs, reasons and states come from other peers.
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined || x === "") return "–";
  if (typeof x === "number") return Number.isInteger(x) && digits === undefined ? String(x) : x.toFixed(digits === undefined ? 3 : digits);
  return String(x);
}

function ago(s) {
  if (s === null || s === undefined) return "–";
  return s < 60 ? s.toFixed(1) + " s ago" : (s / 60).toFixed(1) + " min ago";
}

function fillTable(table, headers, rows) {
  // headers: [label, isNumeric]; rows: arrays of cell values (Node or text)
  const head = el("tr", {}, ...headers.map(([h, num]) => el("th", num ? { class: "num" } : {}, h)));
  const body = rows.map((r) => el("tr", {}, ...r.map((c, i) => el("td", headers[i] && headers[i][1] ? { class: "num" } : {}, c))));
  table.replaceChildren(head, ...body);
}

function pid(id) { return el("span", { class: "pid", title: id }, id); }

// A line chart as inline SVG. series: [{name, color, points: [[x, y], ...], dash (optional: dashed, no dots)}]
function lineChart(container, series, opts) {
  const W = 420, H = 180, L = 40, R = 8, T = 8, B = 22;
  const all = series.flatMap((s) => s.points);
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  if (all.length === 0) {
    container.replaceChildren(el("p", { class: "muted" }, opts && opts.empty || "no data yet"));
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = opts && opts.y0 !== undefined ? opts.y0 : Math.min(...all.map((p) => p[1]));
  let y1 = opts && opts.y1 !== undefined ? opts.y1 : Math.max(...all.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  root.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccc" }));
  root.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccc" }));
  for (const [y, v] of [[sy(y0), y0], [sy(y1), y1]]) {
    const t = svg("text", { x: 2, y: y + 4 }); t.textContent = fmt(v, 2); root.appendChild(t);
  }
  for (const [x, v] of [[sx(x0), x0], [sx(x1), x1]]) {
    const t = svg("text", { x: x - 4, y: H - 6 }); t.textContent = fmt(v, 0); root.appendChild(t);
  }
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    root.appendChild(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": s.dash ? 1 : 1.6, ...(s.dash ? { "stroke-dasharray": s.dash } : {}) }));
    if (s.dash) continue;
    if (s.points.length < 40) for (const p of s.points) root.appendChild(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: s.color }));
  }
  const legend = el("div", { class: "legend" }, ...series.filter((s) => s.name).map((s) => el("span", {}, el("i", { style: `background:${s.color}` }), s.name)));
  container.replaceChildren(root, legend);
}

const PALETTE = ["#2f6fdf", "#1a7f37", "#c0392b", "#b7791f", "#7d3cb5", "#138d90", "#d35400", "#5d6d7e"];

// Poll `url` every `everyMs`, calling render(json); back off on errors and 429s.
function poll(url, everyMs, render, onError) {
  let delay = everyMs;
  async function tick() {
    try {
      const r = await fetch(url, { cache: "no-store" });
      if (r.status === 429) {
        delay = Math.min(30000, 1000 * Number(r.headers.get("Retry-After") || 2));
      } else if (!r.ok) {
        throw new Error(`${url}: HTTP ${r.status}`);
      } else {
        render(await r.json());
        onError("");
        delay = everyMs;
      }
    } catch (e) {
      onError(String(e.message || e));
      delay = Math.min(30000, delay * 2);
    }
    setTimeout(tick, delay);
  }
  tick();
}
