"use strict";
// A node's page: polls its own GET /status (docs/protocol.md §10) and shows state, policy step,
// throughput, recent errors and, when it waits, what for.

const RATE_KEYS = /(_per_s|_s$|tokens|submissions|acked|refused|checked|verdicts|spooled|queue|held|bytes|served)/;
const WAIT_WORDS = /^(waiting|late|idle|ingest unreachable|starting|preparing|evaluating)/;

function cell(v) {
  if (v !== null && typeof v === "object") return JSON.stringify(v);
  return fmt(v);
}

function render(s) {
  document.getElementById("role").textContent = s.role || "node";
  document.getElementById("peer-id").textContent = s.peer_id || "";
  // workers report the policy they generate with; validators and relays the latest step they know or hold
  const step = s.policy_step !== undefined ? s.policy_step : s.latest_step !== undefined ? s.latest_step
    : (s.held_steps && s.held_steps.length ? s.held_steps[s.held_steps.length - 1] : null);
  document.getElementById("policy-step").textContent = fmt(step);
  const state = s.state || (s.role === "relay" ? "serving" : "–");
  const stateEl = document.getElementById("state");
  stateEl.textContent = state;
  stateEl.className = WAIT_WORDS.test(state) ? "state warn" : "state ok";  // waiting states say what for and why
  document.getElementById("waiting").textContent = s.waiting_for ? `waiting for: ${s.waiting_for}` : "";
  document.getElementById("updated").textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";
  const rates = Object.entries(s).filter(([k, v]) => RATE_KEYS.test(k) && (v === null || typeof v !== "object"));
  fillTable(document.getElementById("throughput"), [["", false], ["", true]], rates.map(([k, v]) => [k, cell(v)]));
  const errs = s.last_errors || [];
  const et = document.getElementById("errors");
  if (errs.length === 0) et.replaceChildren(el("tr", {}, el("td", { class: "muted" }, "none")));
  else fillTable(et, [["time", false], ["level", false], ["message", false]],
    errs.slice().reverse().map((e) => [new Date(e.ts_ms).toISOString().slice(11, 19), el("span", { class: e.level === "WARNING" ? "warn" : "bad" }, e.level),
                                       el("span", { style: "white-space: normal" }, e.message)]));
  fillTable(document.getElementById("all"), [["", false], ["", false]],
    Object.entries(s).filter(([k]) => k !== "last_errors").map(([k, v]) => [k, cell(v)]));
}

document.addEventListener("DOMContentLoaded", () => {
  poll("/status", 1000, render, (msg) => { document.getElementById("error").textContent = msg; });
});
