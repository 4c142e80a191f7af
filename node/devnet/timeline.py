"""The devnet's per-step timeline and per-process memory, for ``report.md`` (reads files, ``/proc``).

Sources: the coordinator's ``metrics.jsonl`` step rows (batch wait, train step, policy write,
publish, training-state save, checkpoint and delta bytes, when the step was announced), the
nodes' logs (workers' ``submission … in X s`` lines, the validator's ``verdict … checked in X s``
lines, and every node's hold line, ``node/shardcast/events.py``), and :class:`MemorySampler`'s
readings of each child process during the run.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.shardcast.events import HeldEvent, parse_held

SUBMISSION_LINE = re.compile(r"submission \d+ at step (\d+): (\d+) tokens in ([0-9.]+) s")
VERDICT_LINE = re.compile(r"verdict (?:accept|reject) on \S+ from \S+ \(step (\d+), checked in ([0-9.]+) s\)")
GiB = 1 << 30


@dataclass
class NodeLog:
    """What one node's log says: hold events by step, rollout and check seconds by policy step."""

    held: dict[int, HeldEvent] = field(default_factory=dict)
    rollout_s: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    check_s: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))


def read_node_log(path: Path) -> NodeLog:
    """Parse one node's log (missing or unreadable: empty). A step held twice (a restart) keeps the first."""
    out = NodeLog()
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        ev = parse_held(line)
        if ev is not None:
            out.held.setdefault(ev.step, ev)
            continue
        m = SUBMISSION_LINE.search(line)
        if m:
            out.rollout_s[int(m[1])].append(float(m[3]))
            continue
        m = VERDICT_LINE.search(line)
        if m:
            out.check_s[int(m[1])].append(float(m[2]))
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def step_timeline(steps: list[dict[str, Any]], logs: dict[str, NodeLog]) -> list[dict[str, Any]]:
    """One row per trainer step ``s`` (the policy it publishes is step ``s``).

    Returns:
        Rows with ``step``; ``rollout_s`` (mean seconds per worker submission generated with
        policy ``s − 1``, the batch's usual source) and ``validation_s`` (mean validator check
        seconds of submissions of policy ``s − 1``); from the coordinator ``batch_wait_s`` (its ``wait_s``),
        ``train_s``, ``save_s``, ``publish_s``, ``state_s``, ``checkpoint_bytes``, ``delta_bytes``;
        ``held`` (node → seconds from the announcement until it held step ``s``, with ``via``,
        ``bytes``, ``apply_s``), ``last_node`` and ``last_hold_s`` (the slowest node; ``None`` when
        no node reported holding it).
    """
    rows = []
    for s in steps:
        step = int(s["step"])
        rollouts = [x for log in logs.values() for x in log.rollout_s.get(step - 1, [])]
        checks = [x for log in logs.values() for x in log.check_s.get(step - 1, [])]
        row: dict[str, Any] = {
            "step": step, "rollout_s": _mean(rollouts), "validation_s": _mean(checks), "batch_wait_s": s.get("wait_s"),
            "train_s": s.get("step_time_s"), "save_s": s.get("save_s"), "publish_s": s.get("broadcast_s"), "state_s": s.get("state_s"),
            "checkpoint_bytes": s.get("checkpoint_bytes"), "delta_bytes": s.get("delta_bytes"), "held": {},
            "last_node": None, "last_hold_s": None,
        }
        at = s.get("published_at")
        for name, log in sorted(logs.items()):
            ev = log.held.get(step)
            if ev is None or not isinstance(at, (int, float)):
                continue
            row["held"][name] = {"after_s": round(ev.at - at, 3), "via": ev.via, "bytes": ev.bytes, "fetch_s": ev.elapsed_s,
                                 "apply_s": ev.apply_s}
        if row["held"]:
            row["last_node"], last = max(row["held"].items(), key=lambda kv: kv[1]["after_s"])
            row["last_hold_s"] = last["after_s"]
        rows.append(row)
    return rows


@dataclass
class ProcessMemory:
    """One process's resident memory: the kernel's peak (``VmHWM``) and the highest ``VmRSS``
    seen while the trainer was at each step (bytes)."""

    name: str
    role: str
    peak_bytes: int = 0
    by_step: dict[int, int] = field(default_factory=dict)


def _proc_status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of ``pid`` in bytes, ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    vals = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            vals[key] = int(value.split()[0]) * 1024
    return (vals["VmRSS"], vals["VmHWM"]) if len(vals) == 2 else None


class MemorySampler:
    """Reads every devnet child's ``VmRSS``/``VmHWM`` on each orchestrator tick (Linux ``/proc``).

    A restarted child keeps its name; its peak is the highest over its lives.
    """

    def __init__(self) -> None:
        self.procs: dict[str, ProcessMemory] = {}

    def sample(self, children: list[tuple[str, str, int]], trainer_step: int) -> None:
        """Record ``(name, role, pid)`` of each running child at ``trainer_step``."""
        for name, role, pid in children:
            got = _proc_status(pid)
            if got is None:
                continue
            rss, hwm = got
            mem = self.procs.setdefault(name, ProcessMemory(name, role))
            mem.peak_bytes = max(mem.peak_bytes, hwm)
            mem.by_step[trainer_step] = max(mem.by_step.get(trainer_step, 0), rss)

    def rows(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Per process: ``name``, ``role``, ``peak_bytes``, ``by_step`` (step → bytes) and
        ``growth_bytes``: the highest RSS at trainer step ``steps − 1`` minus that at step 1 (from
        step 1 on every model is loaded; at step ``steps`` the run winds down), ``None`` without two
        such steps. ``steps``: the run's trainer steps (``None``: the highest step seen)."""
        out = []
        for mem in self.procs.values():
            top = steps if steps is not None else max(mem.by_step, default=0)
            later = sorted(k for k in mem.by_step if 1 <= k < top)
            growth = mem.by_step[later[-1]] - mem.by_step[later[0]] if len(later) >= 2 else None
            out.append({"name": mem.name, "role": mem.role, "peak_bytes": mem.peak_bytes, "by_step": dict(sorted(mem.by_step.items())),
                        "growth_bytes": growth})
        return out


def trainer_state_bytes(parameters: int) -> int:
    """fp32 master weights, gradients and AdamW's two moments: 16 bytes per parameter."""
    return 16 * parameters


def rss_budget_bytes(checkpoint_bytes: int) -> int:
    """The profile's memory goal per node: 3 × the bf16 checkpoint + 1 GiB (issue #25)."""
    return 3 * checkpoint_bytes + GiB
