"""Does the default devnet learn, on every seed? Runs ``intellect-node devnet`` with default flags on K seeds.

For each seed it prints the held-out pass rate at the start and the end with their 95 % intervals
(percentile bootstrap over the held-out problems), the gain with its paired-bootstrap interval,
the batch pass-rate trend (mean of the first and last five trainer steps), the held-out curve and
the wall time; then min / median / max of the gains and wall times, and on how many seeds the
gain's interval lies above 0. Goals (issue #16): every seed ≥ +0.10 with its interval above 0,
median gain ≥ +0.20, median wall ≤ 5 min on 2 cores. Seeds run one after another (each devnet
already uses every core); say what else loaded the machine next to any figure you quote (the
script prints the date and the load average before and after each seed).

Every devnet runs with ``INTELLECT_CACHE`` set to one new empty folder (``--cache DIR`` to choose
it), as on a fresh machine: nothing a machine cached earlier enters the figures.

    python benchmarks/devnet_seeds.py                    # 5 seeds: 1..5
    python benchmarks/devnet_seeds.py --seeds 3 --first-seed 11 --steps 40 --keep /tmp/seeds
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.devnet.report import heldout_summary, read_metrics  # noqa: E402


def run_seed(seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One default devnet on ``seed``; its held-out summary, batch pass-rate trend and wall time."""
    out = root / f"seed-{seed}"
    cmd = [sys.executable, "-m", "node", "devnet", "--out", str(out), "--seed", str(seed), "--no-dashboard", "--timeout", str(args.timeout)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 120,
                       env=dict(os.environ, OMP_NUM_THREADS="1", INTELLECT_CACHE=str(args.cache)))
    wall = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "devnet-output.txt").write_text(r.stdout + r.stderr)  # the devnet's own summary, for quoting a real run
    rows = read_metrics(out / "coordinator" / "metrics.jsonl")
    steps = [x for x in rows if x.get("event") == "step"]
    evals = [x for x in rows if x.get("event") == "eval"]
    passes = [float(s["pass_rate"]) for s in steps]
    return {
        "seed": seed, "ok": r.returncode == 0, "wall_s": wall, "steps": len(steps), **heldout_summary(evals),
        "load": (load0, os.getloadavg()[0]),
        "curve": [(e["step"], e["heldout_pass_rate"]) for e in evals],
        "batch_first": statistics.fmean(passes[:5]) if passes else None, "batch_last": statistics.fmean(passes[-5:]) if passes else None,
        "tail": "" if r.returncode == 0 else (r.stdout[-800:] + r.stderr[-800:]),
    }


def _f(x: Any, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5, help="how many seeds (default 5)")
    ap.add_argument("--first-seed", type=int, default=1, help="seeds are first-seed, first-seed + 1, … (default 1)")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default: the devnet's default)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-seed devnet timeout, seconds")
    ap.add_argument("--keep", default=None,
                    help="keep every run's output under this directory, with what the devnet printed in seed-N/devnet-output.txt "
                         "(default: a temporary one)")
    ap.add_argument("--cache", default=None, help="INTELLECT_CACHE of every devnet (default: one new empty folder)")
    args = ap.parse_args()
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="devnet-seeds-")
    root = Path(args.keep or tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    cache_tmp = None if args.cache else tempfile.TemporaryDirectory(prefix="devnet-seeds-cache-")
    args.cache = Path(args.cache or cache_tmp.name)  # type: ignore[union-attr]
    results = []
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"INTELLECT_CACHE={args.cache} ({'empty' if not any(args.cache.iterdir()) else 'not empty'})", flush=True)
    print(f"{'seed':>5} {'start (95 %)':>22} {'end (95 %)':>22} {'gain (95 %)':>26} {'batch pass':>14} {'wall s':>7} {'load':>9}  held-out curve")
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        s = run_seed(seed, args, root)
        results.append(s)
        ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]" if c else ""  # noqa: E731
        gci = f"[{s['gain_ci'][0]:+.3f}, {s['gain_ci'][1]:+.3f}]" if s["gain_ci"] else ""
        curve = " ".join(f"{p:.2f}" for _, p in s["curve"])
        print(f"{seed:>5} {_f(s['start']):>6} {ci(s['start_ci']):>15} {_f(s['end']):>6} {ci(s['end_ci']):>15} "
              f"{_f(s['gain'], '+.3f'):>7} {gci:>18} {_f(s['batch_first'], '.2f'):>6}→{_f(s['batch_last'], '.2f'):<6} "
              f"{s['wall_s']:>7.0f} {s['load'][0]:>4.0f}→{s['load'][1]:<4.0f}  {curve}" + ("" if s["ok"] else "  FAILED"), flush=True)
        if not s["ok"]:
            print(s["tail"], file=sys.stderr)
    gains = [s["gain"] for s in results if s["gain"] is not None]
    walls = [s["wall_s"] for s in results if s["ok"]]
    above = sum(1 for s in results if s["gain_ci"] and s["gain_ci"][0] > 0)
    if gains:
        print(f"\ngain: min {min(gains):+.3f}, median {statistics.median(gains):+.3f}, max {max(gains):+.3f}; "
              f"interval above 0 on {above} of {len(results)} seeds; ≥ +0.10 on {sum(g >= 0.10 for g in gains)}")
    if walls:
        print(f"wall: min {min(walls):.0f} s, median {statistics.median(walls):.0f} s, max {max(walls):.0f} s "
              f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    loads = [x for s in results for x in s["load"]]
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}: load average {min(loads):.0f}–{max(loads):.0f} over the run")
    if tmp is not None:
        tmp.cleanup()
    if cache_tmp is not None:
        cache_tmp.cleanup()


if __name__ == "__main__":
    main()
