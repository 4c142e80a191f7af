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

// A line chart as inline SVG, scaled to its card's width.
// series: [{name, color, points: [[x, y], ...], dash (dashed), width (stroke px), marker ("circle" | "square" | "none")}]
// opts: {xTitle, yTitle, y0, y1, integer (y values are counts: integer ticks), empty (text with no data)}
// Series drawn first lie underneath: a wide pale line under a thin dashed one stays visible where values coincide.
function lineChart(container, series, opts) {
  opts = opts || {};
  const W = 440, H = 200, L = 52, R = 14, T = 10, B = 38;
  const all = series.flatMap((s) => s.points);
  if (all.length === 0) {
    container.replaceChildren(el("p", { class: "muted" }, opts.empty || "no data yet"));
    return;
  }
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": opts.yTitle || "" });
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = opts.y0 !== undefined ? opts.y0 : Math.min(...all.map((p) => p[1]));
  let y1 = opts.y1 !== undefined ? Math.max(opts.y1, ...all.map((p) => p[1])) : Math.max(...all.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  if (opts.integer) y1 = Math.max(Math.ceil(y1), y0 + 1);
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const yfmt = (v) => opts.integer ? String(Math.round(v)) : fmt(v, Math.abs(y1 - y0) >= 10 ? 0 : 2);
  root.appendChild(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccc" }));
  root.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccc" }));
  const yticks = opts.integer && y1 - y0 < 2 ? [y0, y1] : [y0, (y0 + y1) / 2, y1];
  for (const v of yticks) {
    if (opts.integer && !Number.isInteger(v)) continue;
    root.appendChild(svg("line", { x1: L - 3, y1: sy(v), x2: W - R, y2: sy(v), stroke: "#eee" }));
    const t = svg("text", { x: L - 5, y: sy(v) + 4, "text-anchor": "end" }); t.textContent = yfmt(v); root.appendChild(t);
  }
  const xticks = [...new Set([x0, Math.round((x0 + x1) / 2), x1])];
  xticks.forEach((v, i) => {
    const anchor = i === 0 ? "start" : i === xticks.length - 1 ? "end" : "middle";  // the last tick ends at the axis: never clipped
    const t = svg("text", { x: sx(v), y: H - B + 14, "text-anchor": anchor }); t.textContent = fmt(v, 0); root.appendChild(t);
  });
  if (opts.xTitle) {
    const t = svg("text", { x: L + (W - L - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis-title" }); t.textContent = opts.xTitle; root.appendChild(t);
  }
  if (opts.yTitle) {
    const t = svg("text", { x: 0, y: 0, "text-anchor": "middle", class: "axis-title", transform: `translate(12 ${T + (H - T - B) / 2}) rotate(-90)` });
    t.textContent = opts.yTitle; root.appendChild(t);
  }
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    const width = s.width || (s.dash ? 1.2 : 1.6);
    root.appendChild(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": width, "stroke-opacity": s.opacity || 1,
                                   ...(s.dash ? { "stroke-dasharray": s.dash } : {}) }));
    const marker = s.marker || (s.dash ? "none" : "circle");
    if (marker === "none" || s.points.length >= 40) continue;
    for (const p of s.points) {
      root.appendChild(marker === "square"
        ? svg("rect", { x: sx(p[0]) - 2.5, y: sy(p[1]) - 2.5, width: 5, height: 5, fill: "#fff", stroke: s.color })
        : svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: s.color }));
    }
  }
  const swatch = (s) => {
    const sw = svg("svg", { width: 22, height: 10, viewBox: "0 0 22 10", class: "swatch" });
    sw.appendChild(svg("line", { x1: 1, y1: 5, x2: 21, y2: 5, stroke: s.color, "stroke-width": Math.min(4, s.width || 2),
                                 "stroke-opacity": s.opacity || 1, ...(s.dash ? { "stroke-dasharray": s.dash } : {}) }));
    return sw;
  };
  const legend = el("div", { class: "legend" }, ...series.filter((s) => s.name).map((s) => el("span", {}, swatch(s), s.name)));
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
