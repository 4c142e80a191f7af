"""Trainer utilization (busy / wall) of the same devnet at async level 0 and 2.

Runs ``intellect-node devnet`` twice (same seed, steps, workers) and prints, side by side, the
trainer's busy fraction, wall time and held-out pass rates, and the ratio level 2 / level 0.
Goal (issue #9): ≥ 90 % utilization at level 2. On a 2-core machine every process (trainer,
workers, validator, relays) shares the same cores, so the trainer mostly waits for the CPU, not
for rollouts; run on a machine with cores to spare for a meaningful absolute number.

    python benchmarks/devnet_bench.py --steps 20 --workers 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(level: int, args: argparse.Namespace, root: Path) -> dict[str, float]:
    out = root / f"async-{level}"
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "node", "devnet", "--out", str(out), "--steps", str(args.steps), "--workers", str(args.workers),
         "--relays", str(args.relays), "--validators", "1", "--async-level", str(level), "--seed", str(args.seed), "--no-dashboard"],
        capture_output=True, text=True, timeout=args.timeout,
    )
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"devnet at async level {level} failed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    rows = [json.loads(line) for line in (out / "coordinator" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x.get("event") == "step"]
    evals = [x for x in rows if x.get("event") == "eval"]
    busy = sum(s["step_time_s"] for s in steps)
    span = steps[-1]["wall_s"] if steps else float("nan")
    return {
        "utilization": steps[-1]["utilization"] if steps else float("nan"),
        "busy_s": busy,
        "train_wall_s": span,
        "devnet_wall_s": wall,
        "s_per_step": span / max(1, len(steps)),
        "heldout_start": evals[0]["heldout_pass_rate"] if evals else float("nan"),
        "heldout_end": evals[-1]["heldout_pass_rate"] if len(evals) > 1 else float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--relays", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="devnet-bench-") as tmp:
        results = {level: run(level, args, Path(tmp)) for level in (0, 2)}
    print(f"{'metric':<18}{'async 0':>12}{'async 2':>12}{'2 / 0':>10}")
    for key in results[0]:
        a, b = results[0][key], results[2][key]
        ratio = b / a if a else float("nan")
        print(f"{key:<18}{a:>12.3f}{b:>12.3f}{ratio:>10.2f}")
    print(f"goal: utilization ≥ 0.90 at async level 2 -> {'met' if results[2]['utilization'] >= 0.9 else 'not met'}")


if __name__ == "__main__":
    main()
