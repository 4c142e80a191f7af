"""``report.md`` and ``report.png`` of a devnet run, from the coordinator's ``metrics.jsonl``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.devnet.timeline import GiB, NodeLog, read_node_log, rss_budget_bytes, step_timeline, trainer_state_bytes

if TYPE_CHECKING:
    from node.devnet.orchestrator import Devnet, DevnetResult


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (unparseable lines skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def heldout_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Start, end and gain of the held-out pass rate from a run's ``eval`` rows, with 95 % intervals.

    Returns:
        ``start``, ``start_ci``, ``end``, ``end_ci`` (``None`` when missing), ``gain`` and
        ``gain_ci`` (paired bootstrap over the held-out problems, ``node.coordinator.evaluate``;
        ``None`` without two evaluations of the same problems), ``points`` (evaluations) and ``problems``.
    """
    from node.coordinator.evaluate import gain_interval

    def ci(e: dict[str, Any]) -> tuple[float, float] | None:
        lo, hi = e.get("heldout_ci_low"), e.get("heldout_ci_high")
        return (float(lo), float(hi)) if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else None

    out: dict[str, Any] = {"start": None, "start_ci": None, "end": None, "end_ci": None, "gain": None, "gain_ci": None,
                           "points": len(evals), "problems": evals[0].get("problems") if evals else None}
    if evals:
        out["start"], out["start_ci"] = evals[0]["heldout_pass_rate"], ci(evals[0])
    if len(evals) > 1:
        a, b = evals[0], evals[-1]
        out["end"], out["end_ci"] = b["heldout_pass_rate"], ci(b)
        out["gain"] = b["heldout_pass_rate"] - a["heldout_pass_rate"]
        pa, pb = a.get("passes"), b.get("passes")
        if isinstance(pa, list) and isinstance(pb, list) and pa and len(pa) == len(pb):
            _, lo, hi = gain_interval(pa, pb, int(a.get("samples_per_problem") or 0), int(b.get("samples_per_problem") or 0))
            out["gain_ci"] = (lo, hi)
    return out


def _ci(c: tuple[float, float] | None) -> str:
    return f" (95 % {c[0]:.3f}–{c[1]:.3f})" if c else ""


def crash_section(dn: Devnet) -> list[str]:
    """report.md's "Crash and restart" lines for ``--kill-worker-at`` (none without it): the summary's
    sentence, and a pointer to the worker's ``restart:`` log line when there is one (an empty spool logs none)."""
    chaos = dn.chaos_summary()
    if chaos is None:
        return []
    spool = (dn.node_status.get("worker-0") or {}).get("spool_restart")
    logged = isinstance(spool, dict) and bool(spool.get("found"))
    return ["", "## Crash and restart", "", f"{chaos[0].upper()}{chaos[1:]}." +
            (" See `logs/worker-0.log` (the line starting `restart:`)." if logged else "")]


def workers_section(dn: Devnet) -> list[str]:
    """``## Workers``: per worker process its accepted, rejected, pending and trained-on work, and its
    ban with the trainer step the devnet saw it at (:meth:`Devnet.worker_outcomes`); for an
    adversary one sentence more (:meth:`Devnet.adversary_summary`)."""
    lines = ["", "## Workers", "", ("Submissions. Rejected counts include those retired as `stale_policy` (they left the async window "
             "before a verdict: no fault of the worker's), shown in brackets; trained on: submissions a trainer step consumed, and "
             "their rollouts; banned at: the trainer step when the devnet first saw the ban."), "",
             "| node | peer ID | accepted | rejected (stale) | pending | trained on | banned | banned at step | rollouts trained | compute |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, w in dn.worker_outcomes().items():
        rollouts = "-" if w["rollouts_trained"] is None else w["rollouts_trained"]
        at = "-" if w["banned_at_step"] is None else w["banned_at_step"]
        lines.append(f"| {name} | `{w['peer_id']}` | {w['accepted']} | {w['rejected']} ({w['stale']}) | {w['pending']} | {w['trained']} | "
                     f"{w['banned'] or 'no'} | {at} | {rollouts} | {dn.o.worker_dtype} |")
    bans = [(name, w) for name, w in dn.worker_outcomes().items() if w["banned"]]
    if bans:
        lines += ["", "Bans, with the evidence of the verdict that caused each (the run page's final snapshot):", ""]
        for name, w in bans:
            ev = w.get("ban_evidence")
            said = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(ev.items()) if k != "detail") if ev else "-"
            detail = f" ({ev['detail']})" if ev and isinstance(ev.get("detail"), str) else ""
            lines.append(f"- {name}: `{w['banned']}` at trainer step {w['banned_at_step'] if w['banned_at_step'] is not None else '?'}{detail}: {said}")
    if (adversary := dn.adversary_summary()) is not None:
        lines += ["", f"{adversary[0].upper()}{adversary[1:]}."]
    return lines


def write_report(dn: Devnet, result: DevnetResult) -> tuple[Path, Path]:
    """Write ``OUT/report.md`` and ``OUT/report.png``; returns their paths."""
    rows = read_metrics(dn.out / "coordinator" / "metrics.jsonl")
    steps = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    run = next((r for r in rows if r.get("event") == "run"), {})
    st = result.coordinator
    h = heldout_summary(evals)
    png = dn.out / "report.png"
    title = f"intellect-node devnet: run {dn.run_id[:16]}, seed {dn.seed}, {len(steps)} of {dn.o.steps} steps, {run.get('tasks', dn.o.tasks)}"
    _plot(steps, evals, st, png, title)
    gain = "-"
    if h["gain"] is not None:
        gain = f"**{h['gain']:+.3f}**" + (f" (95 % {h['gain_ci'][0]:+.3f} to {h['gain_ci'][1]:+.3f}, paired bootstrap over "
                                         f"{h['problems']} held-out problems)" if h["gain_ci"] else "")
        if h["gain_ci"]:
            lo, hi = h["gain_ci"]
            gain += ("; the interval is above 0: the policy learned" if lo > 0 else "; the interval is below 0: the policy got worse"
                     if hi < 0 else "; the interval includes 0: not distinguishable from noise")
    task_set = f"{run.get('tasks', dn.o.tasks)}" + (f" ({run['train_problems']} training problems, {run['heldout_problems']} held out, "
                                                   f"tasks_hash {str(run.get('tasks_hash', ''))[:12]}…)" if "train_problems" in run else "")
    model = (f"{run.get('model')} ({run.get('parameters', 0):,} parameters, {run.get('dtype')}, hidden {run.get('hidden_size')}, "
             f"{run.get('layers')} layers, vocabulary {run.get('vocab_size')}, chat template {'yes' if run.get('chat_template') else 'no'})"
             if run else (str(dn.o.model) if dn.o.model else "embedded"))
    archive = dn.out / "coordinator" / "run-page" / "index.html"
    page = (f"- run page: the live page was [{dn.coord_url}/]({dn.coord_url}/) while the run ran; its final state is kept in "
            f"[coordinator/run-page/index.html](coordinator/run-page/index.html) (open it in a browser; it draws the same curves as "
            "[report.png](report.png))" if archive.is_file() else
            f"- run page (live while the run ran, gone now): {dn.coord_url}/; the coordinator wrote no final copy, see "
            "[report.png](report.png) for the curves")
    outcome = (f"**completed** {len(steps)} of {dn.o.steps} steps in {result.wall_s:.0f} s" if result.ok else
               f"**FAILED** after {result.wall_s:.0f} s at step {len(steps)} of {dn.o.steps}: {result.reason}")
    lines = [
        "# intellect-node devnet report",
        "",
        f"- run ID `{dn.run_id}`, seed **{dn.seed}** (the same seed again: `intellect-node devnet --seed {dn.seed}` with the same flags)",
        f"- result: {outcome}",
        f"- processes: 1 coordinator, {_n(dn.o.relays, 'relay')}, {_n(dn.o.validators, 'validator')}, {_n(dn.o.workers, 'worker')}"
        + (f", 1 adversary ({dn.o.adversary}" + (f", steering rate {dn.o.steer_rate:g}" if dn.o.adversary == "steer" else "") + ")"
           if dn.o.adversary else "") + f"; workers compute in {dn.o.worker_dtype}",
        f"- task set: {task_set}; trainer steps: {len(steps)} of {dn.o.steps}",
        f"- model: {model}",
        f"- held-out pass rate: start {_f(h['start'])}{_ci(h['start_ci'])} → end {_f(h['end'])}{_ci(h['end_ci'])}",
        f"- held-out gain: {gain}",
        (f"- off-policy: mean mismatch KL(behavior ‖ trainer) {_f(_mean([s.get('mismatch_kl') for s in steps]), 5)} nats per token, "
        f"importance ratio π_trainer/π_behavior in [{_f(min((s.get('is_ratio_min', 1.0) for s in steps), default=None))}, "
        f"{_f(max((s.get('is_ratio_max', 1.0) for s in steps), default=None))}], applied weight at most "
        f"{_f(max((s.get('is_weight_max', 1.0) for s in steps), default=None))} (`rl.is_correction`; mean fraction of tokens truncated "
        f"or masked {_f(_mean([s.get('is_bounded_frac') for s in steps]))}), mean clipped fraction {_f(_mean([s.get('clipped_frac') for s in steps]))}"),
        f"- trainer utilization (busy / wall): {_f(steps[-1].get('utilization') if steps else None)}",
        f"- mean publish time per step (save + cut + sign): {_f(_mean([s.get('broadcast_s') for s in steps]))} s",
        page,
        "",
        "## Verdicts by reason",
        "",
        "| reason | count |",
        "|---|---|",
    ]
    for reason, n in sorted((st.get("verdicts_by_reason") or {}).items()):
        lines.append(f"| {reason} | {n} |")
    lines += workers_section(dn)
    lines += ["", "## Held-out evaluations", "",
              (f"Every {run.get('eval_every') or '-'} steps, {evals[0].get('samples_per_problem', '?') if evals else '?'} samples per "
              "held-out problem; 95 % interval: percentile bootstrap over problems (a problem's samples are correlated, "
              "so a binomial interval over samples would be too narrow)."), "",
              "| policy step | pass rate | 95 % interval | samples |", "|---|---|---|---|"]
    for e in evals:
        lines.append(f"| {e['step']} | {_f(e.get('heldout_pass_rate'))} | {_f(e.get('heldout_ci_low'))}–{_f(e.get('heldout_ci_high'))} | "
                     f"{e.get('samples', '-')} |")
    lines += ["", "## Steps", "",
              ("mismatch KL: k3 estimate of KL(behavior ‖ trainer) over the trained tokens; ratio: π_trainer/π_behavior per token "
              "(min–max); clipped: fraction of loss tokens whose clipped branch was active; staleness: trainer step − policy step "
              "→ rollouts."), "",
              "| step | reward | pass rate | loss | grad norm | mismatch KL | ratio | clipped | staleness | tokens/s | publish s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s['step']} | {_f(s.get('reward_mean'))} | {_f(s.get('pass_rate'))} | {_f(s.get('loss'), 4)} | "
                     f"{_f(s.get('grad_norm'))} | {_f(s.get('mismatch_kl'), 5)} | {_f(s.get('is_ratio_min'), 2)}–{_f(s.get('is_ratio_max'), 2)} | "
                     f"{_f(s.get('clipped_frac'))} | {s.get('staleness')} | {s.get('tokens_per_s', 0):.0f} | {_f(s.get('broadcast_s'))} |")
    lines += timeline_section(dn, steps, run)
    lines += memory_section(dn, run, steps)
    lines += crash_section(dn)
    if dn.events:
        lines += ["", "## Events", ""] + [f"- {e}" for e in dn.events]
    lines += ["", "![report](report.png)", ""]
    md = dn.out / "report.md"
    md.write_text("\n".join(lines))
    write_timeline_json(dn, steps, run)
    return md, png


def write_timeline_json(dn: Devnet, steps: list[dict[str, Any]], run: dict[str, Any]) -> Path:
    """``OUT/timeline.json``: the report's timeline and memory tables as data (``benchmarks/profile_devnet.py``
    reads it): ``steps`` (:func:`node.devnet.timeline.step_timeline` rows), ``memory`` (per process),
    ``parameters``, ``links`` (node → Mb/s, empty without ``--links``)."""
    doc = {"steps": step_timeline(steps, node_logs(dn)), "memory": dn.memory.rows(max((int(s["step"]) for s in steps), default=None)),
           "parameters": run.get("parameters"), "links": {n.name: n.mbit for n in dn.links.nodes.values()} if dn.links else {}}
    path = dn.out / "timeline.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def node_logs(dn: Devnet) -> dict[str, NodeLog]:
    """Every node's parsed log (workers, validators, relays), by process name."""
    return {p.name: read_node_log(p.log) for p in dn.group.procs if p.role != "coordinator"}


def timeline_section(dn: Devnet, steps: list[dict[str, Any]], run: dict[str, Any]) -> list[str]:
    """``## Per-step timeline`` and ``## Policy propagation`` of the report (``node/devnet/timeline.py``)."""
    rows = step_timeline(steps, node_logs(dn))
    lines = ["", "## Per-step timeline", "",
             ("Seconds. rollout: mean worker time per submission generated with policy s−1; validation: mean validator check "
              "time of those submissions; batch wait: the trainer waiting for accepted rollouts; train: the GRPO step; save: "
              "writing the policy (bf16 at a profile); publish: cutting, signing and the delta into the origin; state: saving "
              "the training state (fp32 masters + optimizer); delta / full: the step's published bytes; last holds: seconds from "
              "the announcement until the last node (worker, validator or relay) held step s."), "",
             "| step | rollout | validation | batch wait | train | save | publish | state | full bytes | delta bytes | delta / full | last holds (node) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full, delta = r["checkpoint_bytes"], r["delta_bytes"]
        ratio = f"1/{full / delta:.0f}" if isinstance(full, int) and isinstance(delta, int) and delta else "-"
        last = f"{r['last_hold_s']:.1f} ({r['last_node']})" if r["last_hold_s"] is not None else "-"
        lines.append(f"| {r['step']} | {_f(r['rollout_s'], 1)} | {_f(r['validation_s'], 1)} | {_f(r['batch_wait_s'], 1)} | "
                     f"{_f(r['train_s'], 1)} | {_f(r['save_s'], 1)} | {_f(r['publish_s'], 1)} | {_f(r['state_s'], 1)} | "
                     f"{full if full is not None else '-'} | {delta if delta is not None else '-'} | {ratio} | {last} |")
    held = [(r["step"], name, h) for r in rows for name, h in r["held"].items()]
    if held:
        lines += ["", "## Policy propagation", "",
                  ("Per node and step: seconds from the coordinator's announcement until the node held the step (its hold line, "
                   "`node/shardcast/events.py`), how (delta or full), bytes received, its own fetch time and, by delta, the part "
                   "spent applying it."), "",
                  "| step | node | held after s | via | bytes | fetch s | apply s |", "|---|---|---|---|---|---|---|"]
        for step, name, h in held:
            lines.append(f"| {step} | {name} | {h['after_s']:.2f} | {h['via']} | {h['bytes']} | {h['fetch_s']:.2f} | {h['apply_s']:.2f} |")
    return lines


def memory_section(dn: Devnet, run: dict[str, Any], steps: list[dict[str, Any]]) -> list[str]:
    """``## Memory``: each process's peak RSS, its highest RSS per trainer step, and the profile goal."""
    mem = dn.memory.rows(max((int(s["step"]) for s in steps), default=None))
    if not mem:
        return []
    ckpt = next((s.get("checkpoint_bytes") for s in steps if isinstance(s.get("checkpoint_bytes"), int)), None)
    params = run.get("parameters")
    budget = rss_budget_bytes(ckpt) if ckpt else None
    state = trainer_state_bytes(params) if isinstance(params, int) else None
    all_steps = sorted({k for m in mem for k in m["by_step"]})
    lines = ["", "## Memory (resident set per process)", "",
             ("peak: the kernel's high-water mark (VmHWM) of the process; step k: the highest VmRSS read (every 0.5 s) while the "
              "trainer was at step k (after it finished step k, while it trained step k + 1); growth: step (last − 1) − step 1 "
              "(from step 1 on every model is loaded; the last step's column is the wind-down).")]
    if budget and ckpt:
        apart = (f"; the coordinator's fp32 masters, gradients and AdamW moments take 16 B × {params:,} parameters = "
                 f"{state / GiB:.2f} GiB of its peak, stated apart." if state else ".")
        lines.append(f"Goal per node: ≤ 3 × the bf16 checkpoint ({ckpt / GiB:.2f} GiB) + 1 GiB = {budget / GiB:.2f} GiB{apart}")
    lines += ["", "| process | peak GiB | " + " | ".join(f"step {k}" for k in all_steps) + " | growth MiB | vs goal |",
              "|---|---|" + "---|" * len(all_steps) + "---|---|"]
    for m in sorted(mem, key=lambda m: m["name"]):
        cells = " | ".join(f"{m['by_step'][k] / GiB:.2f}" if k in m["by_step"] else "-" for k in all_steps)
        growth = f"{m['growth_bytes'] / (1 << 20):+.0f}" if m["growth_bytes"] is not None else "-"
        goal = "-"
        if budget:
            peak = m["peak_bytes"] - (state if m["role"] == "coordinator" and state else 0)
            goal = f"{peak / budget:.2f}" + (" (without the trainer state)" if m["role"] == "coordinator" and state else "")
        lines.append(f"| {m['name']} | {m['peak_bytes'] / GiB:.2f} | {cells} | {growth} | {goal} |")
    return lines


def _plot(steps: list[dict[str, Any]], evals: list[dict[str, Any]], st: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 3, figsize=(15, 12))
    x = [s["step"] for s in steps]
    # reward equals the pass rate without a length penalty: wide and pale underneath, dashed on top
    ax[0, 0].plot(x, [s.get("reward_mean") for s in steps], label="reward", linewidth=4, alpha=0.45)
    ax[0, 0].plot(x, [s.get("pass_rate") for s in steps], "--", label="pass rate", linewidth=1.4)
    ax[0, 0].set_title("batch reward and pass rate per step")
    ax[0, 0].set_xlabel("trainer step")
    ax[0, 0].set_ylabel("mean over the batch")
    ax[0, 0].legend()
    ex = [e["step"] for e in evals]
    ax[0, 1].plot(ex, [e["heldout_pass_rate"] for e in evals], "o-", label="held-out pass rate")
    if evals and all(isinstance(e.get("heldout_ci_low"), (int, float)) for e in evals):
        ax[0, 1].fill_between(ex, [e["heldout_ci_low"] for e in evals], [e["heldout_ci_high"] for e in evals], alpha=0.25,
                              label="95 % interval (bootstrap over problems)")
    ax[0, 1].legend(loc="lower right", fontsize=8)
    ax[0, 1].set_title("held-out pass rate")
    ax[0, 1].set_xlabel("policy step")
    ax[0, 1].set_ylabel("pass rate")
    ax[0, 1].set_ylim(0, 1)
    stale: Counter[int] = Counter()
    for s in steps:
        for k, v in (s.get("staleness") or {}).items():
            stale[int(k)] += int(v)
    ax[0, 2].bar([str(k) for k in sorted(stale)], [stale[k] for k in sorted(stale)])
    ax[0, 2].set_title("staleness of trained rollouts")
    ax[0, 2].set_xlabel("trainer step − policy step")
    ax[0, 2].set_ylabel("rollouts trained on")
    verdicts = st.get("verdicts_by_reason") or {}
    ax[1, 0].bar(list(verdicts), list(verdicts.values()), color=["tab:green" if k == "ok" else "tab:red" for k in verdicts])
    ax[1, 0].set_title("verdicts by reason")
    ax[1, 0].set_ylabel("verdicts")
    ax[1, 0].yaxis.get_major_locator().set_params(integer=True)
    ax[1, 0].tick_params(axis="x", rotation=30)
    ax[1, 1].plot(x, [s.get("broadcast_s") or 0 for s in steps])
    ax[1, 1].set_title("publish time per step")
    ax[1, 1].set_xlabel("trainer step")
    ax[1, 1].set_ylabel("seconds (save + cut + sign)")
    ax[1, 2].plot(x, [s.get("utilization") for s in steps])
    ax[1, 2].set_title("trainer utilization")
    ax[1, 2].set_xlabel("trainer step")
    ax[1, 2].set_ylabel("busy / wall")
    ax[1, 2].set_ylim(0, 1)
    ax[2, 0].plot(x, [s.get("mismatch_kl") for s in steps])
    ax[2, 0].set_title("mismatch KL(behavior ‖ trainer)")
    ax[2, 0].set_xlabel("trainer step")
    ax[2, 0].set_ylabel("nats per token")
    ax[2, 1].plot(x, [s.get("is_ratio_min") for s in steps], label="min")
    ax[2, 1].plot(x, [s.get("is_ratio_mean") for s in steps], label="mean")
    ax[2, 1].plot(x, [s.get("is_ratio_max") for s in steps], label="max")
    ax[2, 1].set_yscale("log")
    ax[2, 1].set_title("importance ratio π_trainer / π_behavior")
    ax[2, 1].set_xlabel("trainer step")
    ax[2, 1].set_ylabel("ratio per token (log scale)")
    ax[2, 1].legend(fontsize=8)
    ax[2, 2].plot(x, [s.get("clipped_frac") for s in steps])
    ax[2, 2].set_title("fraction of clipped tokens")
    ax[2, 2].set_xlabel("trainer step")
    ax[2, 2].set_ylabel("fraction of loss tokens")
    from matplotlib.ticker import MaxNLocator

    for a in ax.flat:  # steps are whole numbers: no "2.5" ticks on a short run (verdicts' x is by reason)
        if a is not ax[1, 0]:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _mean(xs: list[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float))]
    return sum(v) / len(v) if v else None


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def _n(count: int, noun: str) -> str:
    """``1 relay``, ``2 relays``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
