"""``report.md`` and ``report.png`` of a devnet run, from the coordinator's ``metrics.jsonl``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def write_report(dn: Devnet, result: DevnetResult) -> tuple[Path, Path]:
    """Write ``OUT/report.md`` and ``OUT/report.png``; returns their paths."""
    rows = read_metrics(dn.out / "coordinator" / "metrics.jsonl")
    steps = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    st = result.coordinator
    start = evals[0]["heldout_pass_rate"] if evals else None
    end = evals[-1]["heldout_pass_rate"] if len(evals) > 1 else None
    png = dn.out / "report.png"
    _plot(steps, evals, st, png)
    names = {v: k for k, v in dn.peer_ids.items()}
    lines = [
        "# intellect-node devnet report",
        "",
        f"- result: **{'completed' if result.ok else 'FAILED'}** ({result.reason}) in {result.wall_s:.0f} s",
        f"- processes: 1 coordinator, {dn.o.relays} relays, {dn.o.validators} validators, {dn.o.workers} workers"
        + (f", 1 adversary ({dn.o.adversary})" if dn.o.adversary else ""),
        f"- tasks: {dn.o.tasks}; trainer steps: {len(steps)} of {dn.o.steps}",
        f"- held-out pass rate: start {_f(start)} → end {_f(end)}" + (f" (change {end - start:+.3f})" if start is not None and end is not None else ""),
        f"- trainer utilization (busy / wall): {_f(steps[-1].get('utilization') if steps else None)}",
        f"- mean publish time per step (save + cut + sign): {_f(_mean([s.get('broadcast_s') for s in steps]))} s",
        f"- run page (live while the run ran): [{dn.coord_url}/]({dn.coord_url}/), JSON at `{dn.coord_url}/api/run`; "
        "it draws the same curves as [report.png](report.png) (reward, pass rate, held-out, verdicts, publish time)",
        "",
        "## Verdicts by reason",
        "",
        "| reason | count |",
        "|---|---|",
    ]
    for reason, n in sorted((st.get("verdicts_by_reason") or {}).items()):
        lines.append(f"| {reason} | {n} |")
    lines += ["", "## Workers", "", "| node | peer ID | accepted | rejected | pending | trained on | banned |", "|---|---|---|---|---|---|---|"]
    banned = {b["peer_id"]: b["reason"] for b in st.get("banned") or []}
    for peer, counts in sorted((st.get("workers") or {}).items(), key=lambda kv: names.get(kv[0], kv[0])):
        lines.append(f"| {names.get(peer, '?')} | `{peer}` | {counts.get('accepted', 0)} | {counts.get('rejected', 0)} | "
                     f"{counts.get('pending', 0)} | {counts.get('trained', 0)} | {banned.get(peer, 'no')} |")
    if dn.o.adversary:
        adv = dn.peer_ids.get("adversary", "")
        trained = (st.get("workers") or {}).get(adv, {}).get("trained", 0)
        lines += ["", f"Adversary `{dn.o.adversary}`: banned = **{'yes (' + banned[adv] + ')' if adv in banned else 'NO'}**, "
                      f"rollouts trained on = **{trained}**."]
    lines += ["", "## Steps", "", "| step | reward | pass rate | loss | grad norm | staleness | tokens/s | publish s |", "|---|---|---|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s['step']} | {_f(s.get('reward_mean'))} | {_f(s.get('pass_rate'))} | {_f(s.get('loss'), 4)} | "
                     f"{_f(s.get('grad_norm'))} | {s.get('staleness')} | {s.get('tokens_per_s', 0):.0f} | {_f(s.get('broadcast_s'))} |")
    if dn.events:
        lines += ["", "## Events", ""] + [f"- {e}" for e in dn.events]
    lines += ["", "![report](report.png)", ""]
    md = dn.out / "report.md"
    md.write_text("\n".join(lines))
    return md, png


def _plot(steps: list[dict[str, Any]], evals: list[dict[str, Any]], st: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    x = [s["step"] for s in steps]
    ax[0, 0].plot(x, [s.get("reward_mean") for s in steps], label="reward")
    ax[0, 0].plot(x, [s.get("pass_rate") for s in steps], label="pass rate")
    ax[0, 0].set_title("batch reward and pass rate per step")
    ax[0, 0].set_xlabel("trainer step")
    ax[0, 0].legend()
    ax[0, 1].plot([e["step"] for e in evals], [e["heldout_pass_rate"] for e in evals], "o-")
    ax[0, 1].set_title("held-out pass rate")
    ax[0, 1].set_xlabel("policy step")
    ax[0, 1].set_ylim(0, 1)
    stale: Counter[int] = Counter()
    for s in steps:
        for k, v in (s.get("staleness") or {}).items():
            stale[int(k)] += int(v)
    ax[0, 2].bar([str(k) for k in sorted(stale)], [stale[k] for k in sorted(stale)])
    ax[0, 2].set_title("staleness of trained rollouts (steps)")
    verdicts = st.get("verdicts_by_reason") or {}
    ax[1, 0].bar(list(verdicts), list(verdicts.values()), color=["tab:green" if k == "ok" else "tab:red" for k in verdicts])
    ax[1, 0].set_title("verdicts by reason")
    ax[1, 0].tick_params(axis="x", rotation=30)
    ax[1, 1].plot(x, [s.get("broadcast_s") or 0 for s in steps])
    ax[1, 1].set_title("publish time per step (s)")
    ax[1, 2].plot(x, [s.get("utilization") for s in steps])
    ax[1, 2].set_title("trainer utilization (busy / wall)")
    ax[1, 2].set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _mean(xs: list[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float))]
    return sum(v) / len(v) if v else None


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"
