"""The devnet at a real shape, end to end, against the goals of issue #25.

Runs ``intellect-node devnet --profile qwen2.5-0.5b`` (hidden 896, 24 layers, 14/2 heads, a
151,936-token byte-level BPE trained on the task text, tied embeddings, random weights, bf16
published, fp32 masters; every role its own process) and prints, from its ``timeline.json``,
``metrics.jsonl`` and the machine afterwards, each goal's measured figure beside its bound:

1. every node's peak RSS ≤ 3 × the bf16 checkpoint + 1 GiB (the coordinator's fp32 masters,
   gradients and AdamW moments, 16 B per parameter, stated apart);
2. delta / full ≤ 1/50 for every published step;
3. every honest verdict ``ok``;
4. nothing left running (no process naming the output folder, no ``--links`` namespace);
5. no process's memory grows step over step (highest RSS at step (last − 1) minus step 1);
6. with ``--links``: every node holds each step within 2 × (its bytes / its link rate) + its
   apply time of the step's announcement.

Heavy: ≈ 16 GB of memory with one worker (the trainer alone ≈ 8 GB before activations) and, on a
shared 2-core machine, tens of minutes per step. Run it when the machine is free, once.

Run: ``python benchmarks/profile_devnet.py [--steps 3] [--workers 1] [--links] [--no-deltas] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GiB = 1 << 30
GROWTH_SHARE, GROWTH_FLOOR = 0.05, 64 << 20
"""Goal 5's tolerance, fixed before measuring: RSS may move by allocator noise, not grow with the steps."""


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the profile's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--links", action="store_true", help="nodes in network namespaces behind capped links (root only)")
    ap.add_argument("--no-deltas", action="store_true", help="every step in full (the comparison run)")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--out", default=None, help="devnet output folder (default: a temporary one, kept)")
    ap.add_argument("--timeout", type=float, default=14400.0)
    args = ap.parse_args()

    from node.devnet.links import PREFIX, namespaces, unavailable
    from node.devnet.report import read_metrics
    from node.devnet.timeline import rss_budget_bytes, trainer_state_bytes

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="profile-devnet-")) / "out"
    cmd = [sys.executable, "-m", "node", "devnet", "--profile", args.profile, "--steps", str(args.steps), "--workers", str(args.workers),
           "--relays", "1", "--data-root", args.data_root, "--out", str(out), "--no-dashboard", "--timeout", str(args.timeout),
           *(["--profile-layers", str(args.layers)] if args.layers else []), *(["--links"] if args.links else []),
           *(["--no-deltas"] if args.no_deltas else [])]
    started = datetime.datetime.now(datetime.UTC)
    print(f"{started:%Y-%m-%d %H:%M} UTC, load average before: {_load()}, memory available "
          f"{psutil.virtual_memory().available / GiB:.1f} GiB", flush=True)
    print(" ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        print(f"  | {line.rstrip()}", flush=True)
    rc = p.wait()
    wall = time.monotonic() - t0
    print(f"devnet exit {rc} after {wall:.0f} s; load average after: {_load()}")
    rows = read_metrics(out / "coordinator" / "metrics.jsonl")
    steps = [r for r in rows if r.get("event") == "step"]
    timeline_path = out / "timeline.json"
    if not timeline_path.exists():
        print(f"no {timeline_path}: the run did not finish; see {out}/logs")
        return 1
    tl = json.loads(timeline_path.read_text())
    ckpt = next((s["checkpoint_bytes"] for s in steps if isinstance(s.get("checkpoint_bytes"), int)), 0)
    params = tl.get("parameters") or 0
    budget = rss_budget_bytes(ckpt)
    state = trainer_state_bytes(params)
    ok_all = rc == 0

    print(f"\nsteps done: {len(steps)} of {args.steps}; bf16 checkpoint {ckpt / GiB:.3f} GiB; {params:,} parameters")
    print(f"\n1. peak RSS ≤ 3 × checkpoint + 1 GiB = {budget / GiB:.2f} GiB (trainer state 16 B/param = {state / GiB:.2f} GiB, apart)")
    print(f"   {'process':<14} {'peak GiB':>9} {'ratio':>7}")
    for m in sorted(tl["memory"], key=lambda m: m["name"]):
        peak = m["peak_bytes"]
        if m["role"] == "coordinator":
            print(f"   {m['name']:<14} {peak / GiB:>9.2f} {(peak - state) / budget:>7.2f}  (without the trainer state; "
                  f"{peak / GiB:.2f} GiB with it)")
            met = peak - state <= budget
        else:
            print(f"   {m['name']:<14} {peak / GiB:>9.2f} {peak / budget:>7.2f}")
            met = peak <= budget
        ok_all &= met
    print("\n2. delta / full ≤ 1/50 per step")
    for s in steps:
        d, f = s.get("delta_bytes"), s.get("checkpoint_bytes")
        if isinstance(d, int) and isinstance(f, int):
            print(f"   step {s['step']}: {d:,} / {f:,} = 1/{f / d:.0f} {'met' if d * 50 <= f else 'MISSED'}")
            ok_all &= d * 50 <= f
        else:
            print(f"   step {s['step']}: no delta published")
    verdicts = steps[-1].get("verdicts", {}) if steps else {}
    print(f"\n3. every honest verdict ok: {verdicts} {'met' if verdicts and set(verdicts) == {'ok'} else 'MISSED'}")
    ok_all &= bool(verdicts) and set(verdicts) == {"ok"}
    time.sleep(2.0)
    me = {os.getpid(), *(a.pid for a in psutil.Process().parents())}  # this script and its callers name the folder too
    left = [q.pid for q in psutil.process_iter(["cmdline"]) if q.pid not in me and str(out) in " ".join(q.info["cmdline"] or [])]
    spaces = [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{p.pid}-")] if unavailable() is None else []
    print(f"\n4. nothing left running: processes {left or 'none'}, namespaces {spaces or 'none'} {'met' if not left and not spaces else 'MISSED'}")
    ok_all &= not left and not spaces
    print(f"\n5. no process's memory grows step over step: highest RSS at step last−1 minus step 1 ≤ "
          f"max({GROWTH_SHARE:.0%} of step 1's, {GROWTH_FLOOR >> 20} MiB) (allocator noise)")
    for m in sorted(tl["memory"], key=lambda m: m["name"]):
        g = m["growth_bytes"]
        by = ", ".join(f"{k}: {v / GiB:.2f}" for k, v in m["by_step"].items())
        if g is None:
            verdict = "not measured (fewer than 2 steps between load and wind-down)"
        else:
            met = g <= max(GROWTH_SHARE * m["by_step"].get("1", m["by_step"].get(1, 0)), GROWTH_FLOOR)
            verdict = "met" if met else "MISSED"
            ok_all &= met
        print(f"   {m['name']:<14} {'-' if g is None else f'{g / (1 << 20):+.0f} MiB':>10} {verdict}   (GiB by step {by})")
    if tl.get("links"):
        print("\n6. by delta, each node holds step s within 2 × (its bytes / its link rate) + its apply time of the announcement")
        print(f"   {'step':>4} {'node':<14} {'via':>5} {'bytes':>12} {'Mb/s':>5} {'held after s':>12} {'bound s':>8} {'ratio':>6}")
        for r in tl["steps"]:
            for name, h in sorted(r["held"].items()):
                mbit = tl["links"].get(name)
                if not mbit:
                    continue
                bound = 2 * h["bytes"] * 8 / (mbit * 1e6) + h["apply_s"]
                met = h["after_s"] <= bound
                print(f"   {r['step']:>4} {name:<14} {h['via']:>5} {h['bytes']:>12,} {mbit:>5} {h['after_s']:>12.2f} {bound:>8.2f} "
                      f"{h['after_s'] / bound if bound else float('inf'):>6.2f} {'met' if met else 'MISSED'}")
                if h["via"] == "delta":
                    ok_all &= met
    print(f"\noutput kept in {out}; every goal {'met' if ok_all else 'NOT met (see above)'}")
    if not args.out and ok_all:
        shutil.rmtree(out.parent, ignore_errors=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
