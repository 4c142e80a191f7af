"""Does asynchrony cost learning? The same devnet at async levels 0, 1, 2 and 4, several seeds each.

Every run is ``intellect-node devnet`` with the same base, tasks, steps and processes; only
``--async-level`` (and, when comparing them, the off-policy correction) and ``--seed`` change. Per
async level (and correction) it prints over the seeds:

* the median held-out gain (last minus first held-out evaluation) with its spread (min–max);
* wall time per trainer step, trainer utilization (train-step time / wall) and the fraction of the
  wall the trainer waited for a batch of accepted rollouts (``wait``; the rest is publishing and
  saving state), over the steady state: from the end of step 1 to the end of the last step, with
  the held-out evaluations the benchmark asks for (they stall the trainer's thread) taken out;
* mean staleness (trainer step − policy step, per trained rollout), mean mismatch KL(behavior ‖
  trainer), the importance ratio π_trainer / π_behavior (mean, min, max over every trained token)
  and what the correction applied (largest weight, fraction of tokens truncated or masked, clipped
  fraction).

Goals (issue #27): level 2's median gain within 0.03 of level 0's, level 4's within 0.05; level 2's
wall time per step ≤ 0.6 × level 0's; utilization ≥ 0.9 at level 2 when rollouts are plentiful.

Corrections (``--corrections``, ``docs/trainer.md`` §2): ``clip`` (the workers' log-probs as the
PPO ratio's denominator, INTELLECT-2's two-sided clip with δ around the behavior policy),
``none`` (recomputed denominator, no staleness correction: INTELLECT-2 as published),
``truncate`` (recomputed denominator × min(π_old/π_behavior, 2): truncated importance sampling),
``mask`` (the same weight, tokens outside [1/2, 2] dropped); ``default`` is the devnet's own
(``clip``, chosen from this benchmark: ``docs/trainer.md`` §9).
At level 0 every rollout comes from the trainer's current weights, so the weight is 1 and every
correction computes the same update: level 0 runs once per seed and stands for all of them.

Runs go one after another, seeds outer and levels inner, so a change of machine load touches
every level alike; ``--jobs N`` runs N at once (only for gains: wall times then share the CPU).
Results go to ``--keep DIR/results.json`` as they come (``--resume`` skips runs already there,
``--no-run`` only summarizes them), the figure of held-out curves per level to ``--plot``.

    python benchmarks/async_levels.py                                  # levels 0 1 2 4, 3 seeds, 60 steps
    python benchmarks/async_levels.py --levels 2,4 --corrections clip,truncate,mask --keep /tmp/al
    python benchmarks/async_levels.py --steps 2 --seeds 1 --workers 1 --relays 0   # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.devnet.report import heldout_summary, read_metrics

CORRECTIONS: dict[str, list[str]] = {
    "default": [],
    "clip": ["old_logprobs=behavior", "is_correction=none"],
    "none": ["old_logprobs=recompute", "is_correction=none"],
    "truncate": ["old_logprobs=recompute", "is_correction=truncate", "is_cap=2.0"],
    "mask": ["old_logprobs=recompute", "is_correction=mask", "is_cap=2.0"],
}
"""``--rl`` flags of each correction compared (``default``: the devnet's run spec as it is)."""

GAIN_GOALS = {2: 0.03, 4: 0.05}
"""Largest allowed drop of the median held-out gain against level 0, per async level."""
WALL_GOAL = 0.6
"""Level 2's wall time per step at most this fraction of level 0's."""
UTILIZATION_GOAL = 0.9


def run_summary(out: Path) -> dict[str, Any]:
    """What one finished devnet says, from its ``coordinator/metrics.jsonl``.

    Returns:
        ``steps``; the held-out summary (``start``, ``end``, ``gain``, ``gain_ci``, ``curve`` as
        ``[step, pass rate]`` pairs); ``s_per_step`` and ``utilization`` over the steady state
        (end of step 1 to end of the last step, held-out evaluations taken out); ``eval_s`` (the
        evaluations' time in that span); ``coordinator_utilization`` (the coordinator's own figure:
        start-up and evaluations in the wall); ``staleness_mean``; ``mismatch_kl`` (mean over
        steps); ``is_ratio_mean``/``min``/``max``; ``is_weight_max``; ``is_bounded_frac``;
        ``clipped_frac`` (means over steps). ``None`` where the run has too few steps.
    """
    rows = read_metrics(out / "coordinator" / "metrics.jsonl")
    steps = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    s: dict[str, Any] = {"steps": len(steps), **heldout_summary(evals), "curve": [[e["step"], e["heldout_pass_rate"]] for e in evals]}
    s["s_per_step"] = s["utilization"] = s["eval_s"] = s["wait_frac"] = None
    if len(steps) >= 2:
        # an evaluation after step n starts when step n's row is written and ends when its row is
        t_step = {r["step"]: float(r["ts"]) for r in steps}
        first, last = float(steps[0]["ts"]), float(steps[-1]["ts"])
        eval_s = sum(max(0.0, float(e["ts"]) - t_step[e["step"]]) for e in evals
                     if e["step"] in t_step and first <= t_step[e["step"]] < last)
        span = last - first - eval_s
        s["eval_s"] = eval_s
        s["s_per_step"] = span / (len(steps) - 1)
        s["utilization"] = sum(float(r["step_time_s"]) for r in steps[1:]) / span if span > 0 else None
        waits = [r.get("wait_s") for r in steps[1:]]
        s["wait_frac"] = sum(float(w) for w in waits) / span if span > 0 and all(isinstance(w, (int, float)) for w in waits) else None
    s["coordinator_utilization"] = steps[-1].get("utilization") if steps else None
    trained = [(int(k), int(v)) for r in steps for k, v in (r.get("staleness") or {}).items()]
    n = sum(v for _, v in trained)
    s["staleness_mean"] = sum(k * v for k, v in trained) / n if n else None
    s["mismatch_kl"] = _mean([r.get("mismatch_kl") for r in steps])
    s["is_ratio_mean"] = _mean([r.get("is_ratio_mean") for r in steps])
    s["is_ratio_min"] = min((float(r["is_ratio_min"]) for r in steps if "is_ratio_min" in r), default=None)
    s["is_ratio_max"] = max((float(r["is_ratio_max"]) for r in steps if "is_ratio_max" in r), default=None)
    s["is_weight_max"] = max((float(r["is_weight_max"]) for r in steps if "is_weight_max" in r), default=None)
    s["is_bounded_frac"] = _mean([r.get("is_bounded_frac") for r in steps])
    s["clipped_frac"] = _mean([r.get("clipped_frac") for r in steps])
    return s


def run_devnet(level: int, correction: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One devnet at ``level`` with ``correction`` on ``seed``; its :func:`run_summary` plus wall time and load."""
    out = root / f"{correction}-L{level}-s{seed}"
    cmd = [sys.executable, "-m", "node", "devnet", "--out", str(out), "--seed", str(seed), "--async-level", str(level),
           "--steps", str(args.steps), "--workers", str(args.workers), "--relays", str(args.relays), "--validators", "1",
           "--eval-samples", str(args.eval_samples), "--no-dashboard", "--timeout", str(args.timeout)]
    for flag in CORRECTIONS[correction]:
        cmd += ["--rl", flag]
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 120, check=False,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=Path(__file__).resolve().parents[1])
        ok, tail = r.returncode == 0, "" if r.returncode == 0 else (r.stdout[-1500:] + r.stderr[-1500:])
    except subprocess.TimeoutExpired:
        ok, tail = False, f"no exit after {args.timeout + 120:.0f} s"
    wall = time.monotonic() - t0
    return {"level": level, "correction": correction, "seed": seed, "ok": ok, "wall_s": wall, "tail": tail,
            "load": [load_before, os.getloadavg()[0]], **run_summary(out)}


def usable(r: dict[str, Any], steps: int) -> bool:
    """A run that trained all ``steps`` and evaluated its last policy: the devnet exited cleanly, or
    its ``--timeout`` ended it after that (its numbers are complete; on a loaded machine the last
    evaluation and the report can outlast the timeout)."""
    return r.get("gain") is not None and (r["ok"] or (r.get("steps") == steps and bool(r.get("curve")) and r["curve"][-1][0] == steps))


def level_table(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Medians and spreads over the seeds of one (level, correction): the :func:`usable` runs."""
    ok = [r for r in runs if usable(r, steps)]
    gains = [r["gain"] for r in ok]

    def med(key: str) -> float | None:
        v = [float(r[key]) for r in ok if r.get(key) is not None]
        return statistics.median(v) if v else None

    return {
        "seeds": len(ok), "failed": len(runs) - len(ok), "gain": statistics.median(gains) if gains else None,
        "gain_min": min(gains, default=None), "gain_max": max(gains, default=None),
        "start": med("start"), "end": med("end"), "s_per_step": med("s_per_step"), "utilization": med("utilization"), "wait_frac": med("wait_frac"),
        "coordinator_utilization": med("coordinator_utilization"), "staleness_mean": med("staleness_mean"),
        "mismatch_kl": med("mismatch_kl"), "is_ratio_mean": med("is_ratio_mean"),
        "is_ratio_min": min((r["is_ratio_min"] for r in ok if r.get("is_ratio_min") is not None), default=None),
        "is_ratio_max": max((r["is_ratio_max"] for r in ok if r.get("is_ratio_max") is not None), default=None),
        "is_weight_max": max((r["is_weight_max"] for r in ok if r.get("is_weight_max") is not None), default=None),
        "is_bounded_frac": med("is_bounded_frac"), "clipped_frac": med("clipped_frac"),
        "load": [min((r["load"][0] for r in runs), default=None), max((max(r["load"]) for r in runs), default=None)],
    }


def plot(results: list[dict[str, Any]], levels: list[int], corrections: list[str], steps: int, path: Path) -> None:
    """Held-out curves per async level: one panel per level, each seed thin, the median bold, level 0's
    median dashed for reference (first correction); with several corrections a second row overlays
    their median curves per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if len(corrections) > 1 else 1
    fig, ax = plt.subplots(rows, len(levels), figsize=(4.2 * len(levels), 3.6 * rows), squeeze=False, sharey=True)

    def median_curve(level: int, correction: str) -> tuple[list[int], list[float]]:
        curves = [r["curve"] for r in _runs(results, level, correction) if usable(r, steps)]
        xs = sorted({s for c in curves for s, _ in c if all(any(t == s for t, _ in c2) for c2 in curves)})
        return xs, [statistics.median(p for c in curves for t, p in c if t == s) for s in xs]

    ref = median_curve(0, corrections[0]) if 0 in levels else ([], [])
    for i, level in enumerate(levels):
        a = ax[0, i]
        for r in _runs(results, level, corrections[0]):
            if usable(r, steps):
                a.plot([s for s, _ in r["curve"]], [p for _, p in r["curve"]], "-", color="tab:blue", alpha=0.35, lw=1)
        x, y = median_curve(level, corrections[0])
        a.plot(x, y, "o-", color="tab:blue", lw=2, label=f"median ({corrections[0]})")
        if level != 0 and ref[0]:
            a.plot(*ref, "--", color="black", lw=1, label="level 0 median")
        t = level_table(_runs(results, level, corrections[0]), steps)
        a.set_title(f"async level {level}: gain {_f(t['gain'], '+.3f')} (median of {t['seeds']})")
        a.set_xlabel("policy step")
        a.set_ylim(0, 1)
        a.legend(loc="lower right", fontsize=8)
        if rows > 1:
            b = ax[1, i]
            for c in corrections if level else corrections[:1]:
                x, y = median_curve(level, c)
                b.plot(x, y, "o-", ms=3, label=c if level else "every correction (w = 1)")
            b.set_title(f"async level {level}: median held-out per correction")
            b.set_xlabel("policy step")
            b.legend(loc="lower right", fontsize=8)
    ax[0, 0].set_ylabel("held-out pass rate")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _runs(results: list[dict[str, Any]], level: int, correction: str) -> list[dict[str, Any]]:
    """Runs of ``level`` with ``correction`` (level 0 runs stand for every correction)."""
    return [r for r in results if r["level"] == level and (level == 0 or r["correction"] == correction)]


def _mean(xs: list[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float))]
    return sum(v) / len(v) if v else None


def _f(x: Any, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="0,1,2,4", help="async levels, comma-separated (default 0,1,2,4)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per level (default 3)")
    ap.add_argument("--first-seed", type=int, default=1, help="seeds are first-seed, first-seed + 1, … (default 1)")
    ap.add_argument("--steps", type=int, default=60, help="trainer steps per run (default 60, the devnet's)")
    ap.add_argument("--corrections", default="default",
                    help=f"off-policy corrections to compare, comma-separated, from {sorted(CORRECTIONS)} (default: the devnet's own); "
                         "the first one gets the last line")
    ap.add_argument("--workers", type=int, default=2, help="workers per devnet (default 2, the devnet's)")
    ap.add_argument("--relays", type=int, default=2, help="relays per devnet (default 2, the devnet's)")
    ap.add_argument("--eval-samples", type=int, default=16, help="samples per held-out problem per evaluation (default 16)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-run devnet timeout, seconds (default 1800: a loaded 2-core machine took 35 s a step at level 0)")
    ap.add_argument("--jobs", type=int, default=1, help="devnets at once (default 1; more shares the CPU: gains only)")
    ap.add_argument("--keep", default=None, help="keep every run and results.json under this directory (default: a temporary one)")
    ap.add_argument("--resume", action="store_true", help="skip runs already in --keep DIR/results.json")
    ap.add_argument("--no-run", action="store_true", help="run nothing: summarize what --keep DIR/results.json holds")
    ap.add_argument("--plot", default=None, help="write the held-out curves per level to this PNG")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    corrections = [c.strip() for c in args.corrections.split(",") if c.strip()]
    if not levels or any(lv < 0 for lv in levels) or args.seeds < 1 or args.steps < 1 or args.jobs < 1:
        raise SystemExit("need --levels of async levels ≥ 0, --seeds ≥ 1, --steps ≥ 1 and --jobs ≥ 1")
    if unknown := [c for c in corrections if c not in CORRECTIONS]:
        raise SystemExit(f"unknown corrections {unknown}; choose from {sorted(CORRECTIONS)}")
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="async-levels-")
    root = Path(args.keep or tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    store = root / "results.json"
    results: list[dict[str, Any]] = json.loads(store.read_text()) if (args.resume or args.no_run) and store.exists() else []
    done = {(r["level"], r["correction"], r["seed"]) for r in results if usable(r, args.steps)}
    results = [r for r in results if usable(r, args.steps)]
    plan = [(lv, c if lv else corrections[0], seed) for seed in range(args.first_seed, args.first_seed + args.seeds)
            for lv in levels for c in (corrections if lv else corrections[:1])]
    plan = [] if args.no_run else [p for p in plan if p not in done]
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}; {len(plan)} devnets of {args.steps} steps ({args.workers} workers, "
          f"{args.relays} relays) on {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_devnet, lv, c, seed, args, root) for lv, c, seed in plan]
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results.append(r)
            store.write_text(json.dumps(results, indent=1))
            state = "ok" if r["ok"] else "timed out after its last step (complete)" if usable(r, args.steps) else "FAILED"
            print(f"  level {r['level']} {r['correction']:<8} seed {r['seed']}: {state}, gain {_f(r.get('gain'), '+.3f')}, "
                  f"{_f(r['s_per_step'], '.2f')} s/step, utilization {_f(r['utilization'], '.2f')}, staleness {_f(r['staleness_mean'], '.2f')}, "
                  f"ratio max {_f(r['is_ratio_max'], '.2f')}, {r['wall_s']:.0f} s, load {r['load'][0]:.1f}→{r['load'][1]:.1f}", flush=True)
            if not usable(r, args.steps):
                print(r["tail"], file=sys.stderr)
    head = (f"{'level':>5} {'correction':<10} {'seeds':>5} {'gain (min–max)':>22} {'held-out':>13} {'s/step':>7} {'util':>5} {'wait':>5} "
            f"{'stale':>5} {'mism. KL':>9} {'ratio mean [min, max]':>26} {'w max':>6} {'bounded':>7} {'clipped':>7}")
    print("\n" + head)
    tables: dict[tuple[int, str], dict[str, Any]] = {}
    for c in corrections:
        for lv in levels:
            t = tables[(lv, c)] = level_table(_runs(results, lv, c), args.steps)
            if not t["seeds"] and not t["failed"]:
                continue  # not run (--no-run over part of a comparison)
            print(f"{lv:>5} {c:<10} {t['seeds']:>5} {_f(t['gain'], '+.3f'):>7} ({_f(t['gain_min'], '+.3f')}–{_f(t['gain_max'], '+.3f')}) "
                  f"{_f(t['start'], '.2f'):>5}→{_f(t['end'], '.2f'):<5} {_f(t['s_per_step'], '.2f'):>7} {_f(t['utilization'], '.2f'):>5} {_f(t['wait_frac'], '.2f'):>5} "
                  f"{_f(t['staleness_mean'], '.2f'):>5} {_f(t['mismatch_kl'], '.4f'):>9} "
                  f"{_f(t['is_ratio_mean'], '.2f'):>9} [{_f(t['is_ratio_min'], '.3f')}, {_f(t['is_ratio_max'], '.1f')}] "
                  f"{_f(t['is_weight_max'], '.2f'):>6} {_f(t['is_bounded_frac'], '.3f'):>7} {_f(t['clipped_frac'], '.3f'):>7}"
                  + (f"  ({t['failed']} failed)" if t["failed"] else ""))
    c0 = corrections[0]
    base = tables.get((0, c0))
    if base and base["gain"] is not None:
        for lv, tol in GAIN_GOALS.items():
            t = tables.get((lv, c0))
            if t and t["gain"] is not None:
                d = t["gain"] - base["gain"]
                print(f"goal: level {lv} median gain within {tol:.2f} of level 0's: {d:+.3f} -> {'met' if d >= -tol else 'missed'}")
        t2 = tables.get((2, c0))
        if t2 and t2["s_per_step"] and base["s_per_step"]:
            ratio = t2["s_per_step"] / base["s_per_step"]
            print(f"goal: level 2 wall time per step ≤ {WALL_GOAL} × level 0's: {ratio:.2f} × -> {'met' if ratio <= WALL_GOAL else 'missed'}")
    t2 = tables.get((2, c0))
    if t2 and t2["utilization"] is not None:
        print(f"goal: trainer utilization ≥ {UTILIZATION_GOAL} at level 2 ({args.workers} workers): {t2['utilization']:.2f} -> "
              f"{'met' if t2['utilization'] >= UTILIZATION_GOAL else 'missed'}")
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {datetime.datetime.now():%Y-%m-%d %H:%M}")
    if args.plot:
        plot(results, levels, corrections, args.steps, Path(args.plot))
        print(f"figure: {args.plot}")
    counts = sorted({tables[(lv, c0)]["seeds"] for lv in levels})  # seeds whose run was usable, per level
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    print("async levels: " + ", ".join(f"{lv} → {_f(tables[(lv, c0)]['gain'], '+.3f')}" for lv in levels)
          + f" (median held-out gain over {seeds} seeds)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
