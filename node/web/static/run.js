"use strict";
// The run page: polls GET /api/run (docs/protocol.md §10.1) and redraws every section.

function renderSpec(run) {
  const rows = [
    ["run", `${run.name} (${run.run_id.slice(0, 16)}…)`],
    ["coordinator", pid(run.coordinator)],
    ["validators (keys in the spec)", run.validators],
    ["model", `${run.model.base} · hidden ${run.model.hidden_size} · ${run.model.dtype}`],
    ["tasks", `${run.tasks} · ${run.tasks_per_submission} per submission`],
    ["sampling", `temperature ${run.sampling.temperature} · top-p ${run.sampling.top_p} · ≤ ${run.sampling.max_tokens} tokens`],
    ["GRPO", `group ${run.rl.group_size} · ${run.rl.batch_groups} groups per step · async level ${run.rl.async_level} · lr ${run.rl.learning_rate}`],
    ["Shardcast", `keep ${run.shardcast.keep_steps} steps · pieces of ${(run.shardcast.piece_size_bytes / 1024).toFixed(0)} KiB`],
    ["heartbeat", `${run.heartbeat_interval_s} s`],
  ];
  if (run.environment) {
    rows.splice(5, 0, ["environment", `${run.environment.name} · hash ${run.environment.hash.slice(0, 16)}…`],
      ["environment faults", `${run.environment.faults} submissions rejected as "environment": its own reward code crashed, `
        + "ran over a limit or did not reproduce (the environment's fault, never a worker's: no ban)"]);
  }
  fillTable(document.getElementById("spec"), [["", false], ["", false]], rows);
}

function renderCurves(curves) {
  const steps = curves.steps;
  // batch reward equals the pass rate when a run has no length penalty: reward is drawn wide and pale
  // underneath, pass rate thin and dashed on top, so both stay visible where they coincide
  lineChart(document.getElementById("chart-reward"), [
    { name: "batch reward", color: PALETTE[0], width: 4, opacity: 0.45, marker: "none",
      points: steps.filter((s) => s.reward_mean !== null).map((s) => [s.step, s.reward_mean]) },
    { name: "batch pass rate", color: PALETTE[1], width: 1.4, dash: "5 3",
      points: steps.filter((s) => s.pass_rate !== null).map((s) => [s.step, s.pass_rate]) },
    { name: "held-out pass rate", color: PALETTE[2], width: 2, marker: "square", points: curves.heldout.map((e) => [e.step, e.pass_rate]) },
    { name: "held-out 95 % interval", color: PALETTE[2], dash: "2 3", width: 1,
      points: curves.heldout.filter((e) => e.ci_low !== null && e.ci_low !== undefined).map((e) => [e.step, e.ci_low]) },
    { name: "", color: PALETTE[2], dash: "2 3", width: 1,
      points: curves.heldout.filter((e) => e.ci_high !== null && e.ci_high !== undefined).map((e) => [e.step, e.ci_high]) },
  ], { empty: "no trainer step yet", xTitle: "trainer step (held-out: policy step)", yTitle: "reward / pass rate" });
  const reasons = [...new Set(curves.verdicts.flatMap((v) => Object.keys(v.by_reason)))].sort();
  lineChart(document.getElementById("chart-verdicts"), reasons.map((r, i) => ({
    name: r, color: r === "ok" ? PALETTE[1] : PALETTE[(i + 2) % PALETTE.length], dash: r === "ok" ? undefined : ["5 3", "2 2", "8 3 2 3"][i % 3],
    marker: r === "ok" ? "circle" : "square",
    points: curves.verdicts.map((v) => [v.step, v.by_reason[r] || 0]),
  })), { y0: 0, integer: true, empty: "no verdicts yet", xTitle: "trainer step", yTitle: "verdicts so far" });
}

function renderPropagation(prop) {
  const rows = prop.slice(-12).reverse();
  lineChart(document.getElementById("chart-propagation"), [
    { name: "origin publish", color: PALETTE[3], marker: "square", points: prop.filter((p) => p.publish_s !== null).map((p) => [p.step, p.publish_s]) },
    { name: "last relay", color: PALETTE[0], width: 3, opacity: 0.5, points: prop.filter((p) => p.relays_all_s !== null).map((p) => [p.step, p.relays_all_s]) },
    { name: "last worker", color: PALETTE[1], dash: "5 3", points: prop.filter((p) => p.workers_all_s !== null).map((p) => [p.step, p.workers_all_s]) },
  ], { y0: 0, empty: "no policy published yet", xTitle: "policy step", yTitle: "seconds" });
  fillTable(document.getElementById("propagation"),
    [["step", true], ["publish s", true], ["first relay", true], ["all relays", true], ["first worker", true], ["all workers", true], ["relays", true], ["workers", true]],
    rows.map((p) => [p.step, fmt(p.publish_s), fmt(p.relays_first_s), fmt(p.relays_all_s), fmt(p.workers_first_s), fmt(p.workers_all_s),
                     p.relays_holding, p.workers_on_step]));
}

function renderNodes(nodes) {
  const order = { coordinator: 0, relay: 1, validator: 2, worker: 3, observer: 4 };
  const sorted = [...nodes].sort((a, b) => (order[a.role] - order[b.role]) || a.peer_id.localeCompare(b.peer_id));
  fillTable(document.getElementById("nodes"),
    [["role", false], ["peer ID", false], ["state", false], ["policy step", true], ["held steps", false], ["last heartbeat", false], ["HTTP", false], ["version", false]],
    sorted.map((n) => [n.role, pid(n.peer_id), el("span", { class: n.state === "alive" ? "ok" : "warn" }, n.state), n.policy_step >= 0 ? fmt(n.policy_step) : "—",  // −1: none (relays; a validator before its first verdict)
                       (n.held_steps || []).join(" "), ago(n.last_seen_s), n.http_url || "", n.version || ""]));
}

function renderLeaderboard(rows) {
  fillTable(document.getElementById("leaderboard"),
    [["#", true], ["worker peer ID", false], ["accepted", true], ["rejected", true], ["pending", true], ["rollouts trained on", true],
     ["tokens generated", true], ["reputation", true], ["ban", false]],
    rows.map((w, i) => [i + 1, pid(w.peer_id), w.accepted, w.rejected, w.pending, w.rollouts_trained, w.tokens,
                        fmt(w.reputation, 2), w.banned ? el("span", { class: "bad" }, `banned: ${w.ban_reason}`) : el("span", { class: "ok" }, "no")]));
  const table = document.getElementById("leaderboard");
  table.querySelectorAll("tr").forEach((tr, i) => { if (i > 0) tr.setAttribute("data-peer", rows[i - 1].peer_id); });
}

function renderBans(bans) {
  const table = document.getElementById("bans");
  if (bans.length === 0) { table.replaceChildren(el("tr", {}, el("td", { class: "muted" }, "nobody is banned"))); return; }
  fillTable(table, [["peer ID", false], ["reason", false], ["since", false], ["verdict", false], ["validator", false], ["evidence", false]],
    bans.map((b) => [pid(b.peer_id), el("span", { class: "bad" }, b.reason), new Date(b.since_ms).toISOString().slice(11, 19) + " UTC",
                     b.verdict_id ? b.verdict_id.slice(0, 16) + "…" : "–", b.validator ? pid(b.validator) : "–",
                     b.evidence ? Object.entries(b.evidence).map(([k, v]) => `${k}=${v}`).join(", ") : "(not held since a restart)"]));
}

function render(d) {
  document.getElementById("run-name").textContent = `run ${d.run.name}`;
  document.getElementById("policy-step").textContent = d.trainer.published_step;
  document.getElementById("trainer-step").textContent = d.trainer.step;
  document.getElementById("trainer-state").textContent = d.trainer.state;
  document.getElementById("updated").textContent = "updated " + new Date(d.generated_ms).toISOString().slice(11, 19) + " UTC";
  renderSpec(d.run);
  renderCurves(d.curves);
  renderPropagation(d.propagation);
  renderNodes(d.nodes);
  renderLeaderboard(d.leaderboard);
  renderBans(d.bans);
}

document.addEventListener("DOMContentLoaded", () => {
  // the copy the coordinator writes when it stops (run-page/index.html) carries its last snapshot
  // in RUN_SNAPSHOT (snapshot.js) and draws it once instead of polling a server that is gone
  if (window.RUN_SNAPSHOT) {
    render(window.RUN_SNAPSHOT);
    document.getElementById("updated").textContent =
      "final state, saved " + new Date(window.RUN_SNAPSHOT.generated_ms).toISOString().slice(0, 19).replace("T", " ") + " UTC (the run has ended)";
    return;
  }
  poll("/api/run", 1000, render, (msg) => { document.getElementById("error").textContent = msg; });
});
