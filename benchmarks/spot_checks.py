"""Reputation-weighted spot checks: detection of cheaters by simulation, and validator CPU per accepted rollout.

Two parts, one run (``docs/validator.md`` §5):

1. **Detection, simulated.** Workers under the validator's real policy
   (:class:`validator.spot.SpotCheckPolicy`), history rule (:func:`validator.spot.next_verified`)
   and selection (:func:`validator.spot.selected`, here with a keyed BLAKE2b in place of the
   validator's ed25519 signature: both are pseudo-random functions of the submission ID under a
   key the worker lacks, and BLAKE2b is ~50× faster). A cheater first behaves honestly until its
   share reaches the floor (the cheapest place to cheat from), then cheats in a fraction ``c`` of
   its submissions; a full check of a cheating submission catches it with probability ``q``, and
   the catch bans it (the coordinator's re-check reproduces it, ``docs/validator.md`` §4). For
   each ``c`` it prints the stated bound ``N`` (caught within ``N`` submissions with ≥ 99.9 %,
   :func:`validator.spot.submissions_to_catch`), the simulated share caught within ``N`` and the
   99.9 % quantile, and the cheating submissions and rollouts accepted before the ban, measured
   against :func:`validator.spot.expected_accepted_cheats`.
2. **Economics, measured.** At ``benchmarks/validator_bench.py``'s default shape and at the
   devnet's (the default run spec with the shipped embedded base) the honest worker code builds
   submissions and the real pipeline checks each in full and light (``SubmissionChecker.check(
   full=False)``: window, replay, task derivation, bounds, declared termination, rewards);
   process CPU seconds per submission. With the share an
   all-honest population pays after warm-up (simulated: mean share over each worker's
   submissions after ``--warmup``) it prints ``validator CPU per accepted rollout / worker's``
   (goal ≤ 1/20), and the same at full checks for everyone.

Example::

    python benchmarks/spot_checks.py
    python benchmarks/spot_checks.py --cheaters 400 --min-share 0.05 --full-checks 20 --submissions 6
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from validator.spot import (
    DEFAULT_FULL_CHECKS,
    DEFAULT_MIN_SHARE,
    SpotCheckPolicy,
    expected_accepted_cheats,
    next_verified,
    selected,
    submissions_to_catch,
)


def keyed(secret: bytes):
    """A keyed pseudo-random function standing in for the validator's signature in simulation."""
    return lambda message: hashlib.blake2b(message, key=secret, digest_size=32).digest()


def simulate_cheater(policy: SpotCheckPolicy, rng: random.Random, sign, c: float, q: float, limit: int) -> tuple[int, int]:
    """Honest until the share reaches the floor, then cheating in a fraction ``c``. Returns (cheating
    phase submissions until caught, cheating submissions accepted before it); ``limit + 1`` if not caught."""
    verified = 0
    while policy.share(verified) > policy.min_share:
        verified = next_verified(verified, "ok", selected(sign, rng.randbytes(32), policy.share(verified)))
    accepted = 0
    for n in range(1, limit + 1):
        full = selected(sign, rng.randbytes(32), policy.share(verified))
        cheat = rng.random() < c
        if cheat and full and rng.random() < q:
            return n, accepted
        verified = next_verified(verified, "ok", full)  # accepted (a cheat passed unchecked, or a full check missed it)
        accepted += cheat
    return limit + 1, accepted


def honest_share(policy: SpotCheckPolicy, rng: random.Random, sign, warmup: int, span: int) -> tuple[float, float]:
    """(mean share over submissions [0, warmup), mean share over [warmup, warmup + span)) of one honest worker."""
    verified, early, late = 0, 0.0, 0.0
    for i in range(warmup + span):
        share = policy.share(verified)
        if i < warmup:
            early += share
        else:
            late += share
        verified = next_verified(verified, "ok", selected(sign, rng.randbytes(32), share))
    return early / max(1, warmup), late / max(1, span)


def detection(args: argparse.Namespace, policy: SpotCheckPolicy, rollouts_per_submission: int) -> None:
    sign = keyed(b"validator-secret")
    rng = random.Random(args.seed)
    f = policy.min_share
    print(f"policy: full checks until {policy.full_checks} verified, then full_checks / verified, floor {f}; detection per full check q = {args.q}")
    print(f"{'c':>6}{'bound N (99.9 %)':>18}{'caught within N':>17}{'99.9 % quantile':>17}{'mean to catch':>15}"
          f"{'accepted cheats':>17}{'(stated)':>10}{'rollouts':>10}")
    for c in args.cheat_fractions:
        bound = submissions_to_catch(c, f, 0.999, args.q)
        t0 = time.perf_counter()
        runs = [simulate_cheater(policy, rng, sign, c, args.q, 3 * bound) for _ in range(args.cheaters)]
        ns = sorted(n for n, _ in runs)
        within = sum(n <= bound for n in ns) / len(ns)
        q999 = ns[min(len(ns) - 1, math.ceil(0.999 * len(ns)) - 1)]
        accepted = statistics.mean(a for _, a in runs)
        print(f"{c:6.2%}{bound:18,d}{within:17.2%}{q999:17,d}{statistics.mean(ns):15,.0f}{accepted:17.2f}"
              f"{expected_accepted_cheats(f, args.q):10.2f}{accepted * rollouts_per_submission:10.1f}"
              f"   ({args.cheaters} cheaters, {time.perf_counter() - t0:.1f} s)")


def measured_costs(args: argparse.Namespace, profile: str) -> tuple[float, float, float, int]:
    """(worker, full check, light check) process CPU seconds per submission and rollouts per submission.

    ``profile``: ``"bench"``, the default shape of ``benchmarks/validator_bench.py`` (random-weight
    Qwen2, hidden 384, 4 layers, vocab 4,096, 4 tasks × 4 rollouts × 192 tokens, EOS disabled);
    ``"devnet"``, the default run spec with the shipped embedded base (hidden 128, vocab 99, 2 tasks ×
    8 rollouts, answers of a few tokens: fixed per-call costs dominate everything).
    """
    import torch

    from benchmarks.validator_bench import make_model, make_tokenizer
    from node.coordinator.base import prepare_base
    from node.engine.hf import TransformersEngine
    from node.worker.rollouts import build_submission
    from protocol.dataset import resolve_tasks
    from protocol.envelope import open_envelope
    from protocol.identity import NodeKey
    from protocol.messages import Submission
    from protocol.models import load_model, load_tokenizer
    from protocol.runspec import DataSpec, ModelSpec, RLSpec, RunInfo, RunSpec, SamplingSpec, ToplocSpec
    from validator.pipeline import SubmissionChecker

    torch.set_num_threads(args.threads)
    coord, worker = NodeKey.from_seed(b"c" * 32), NodeKey.from_seed(b"w" * 32)
    if profile == "devnet":
        spec = RunSpec(run=RunInfo(coordinator=coord.peer_id, seed=1))  # the defaults: what a devnet runs
        tasks = resolve_tasks(spec.data.tasks)
        base = prepare_base(spec, tasks, Path(args.cache))
        model, tok = load_model(base), load_tokenizer(base)
    else:
        spec = RunSpec(run=RunInfo(coordinator=coord.peer_id, seed=1), model=ModelSpec(hidden_size=384), data=DataSpec(tasks_per_submission=4),
                       sampling=SamplingSpec(max_tokens=192), toploc=ToplocSpec(eos_min_prob=1.0), rl=RLSpec(group_size=4))
        tasks = resolve_tasks("embedded")
        model, tok = make_model(4096, 384, 4, 8, seed=0), make_tokenizer(4096)
    engine = TransformersEngine(model, tok)
    checker = SubmissionChecker(spec, tasks.train, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False)
    rows = []
    for counter in range(args.submissions + 1):
        c0 = time.process_time()
        blob = build_submission(spec, spec.run_id, worker, engine, tok, tasks.train, 0, counter)
        w = time.process_time() - c0
        env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
        c0 = time.process_time()
        full = checker.check(env, full=True)
        fs = time.process_time() - c0
        c0 = time.process_time()
        light = checker.check(env, full=False)
        ls = time.process_time() - c0
        if not (full.accepted and light.accepted):
            raise SystemExit(f"honest submission rejected: {full.reason} / {light.reason}")
        if counter:  # the first is warm-up
            rows.append((w, fs, ls))
    med = statistics.median
    return med(r[0] for r in rows), med(r[1] for r in rows), med(r[2] for r in rows), len(env.body.rollouts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--full-checks", type=int, default=DEFAULT_FULL_CHECKS, help="the policy's N")
    ap.add_argument("--min-share", type=float, default=DEFAULT_MIN_SHARE, help="the policy's floor f_min")
    ap.add_argument("--cheat-fractions", type=float, nargs="+", default=[0.01, 0.1, 1.0], help="c: share of a cheater's submissions that cheat")
    ap.add_argument("--q", type=float, default=1.0, help="probability that a full check catches a cheating submission")
    ap.add_argument("--cheaters", type=int, default=1000, help="simulated cheaters per cheat fraction")
    ap.add_argument("--warmup", type=int, default=5000, help="an honest worker's submissions counted as warm-up")
    ap.add_argument("--span", type=int, default=5000, help="submissions after the warm-up averaged for the steady share")
    ap.add_argument("--honest", type=int, default=50, help="simulated honest workers")
    ap.add_argument("--submissions", type=int, default=2, help="real submissions measured per profile for the costs (after one warm-up)")
    ap.add_argument("--profiles", nargs="+", choices=["bench", "devnet"], default=["bench", "devnet"],
                    help="bench: validator_bench.py's default shape; devnet: the default run spec with the embedded base")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the measured worker and validator")
    ap.add_argument("--cache", default=os.environ.get("INTELLECT_CACHE", str(Path.home() / ".cache" / "intellect-node")),
                    help="base-model cache directory (only a non-shipped base is built there)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policy = SpotCheckPolicy(args.full_checks, args.min_share)
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.1f}")
    costs = {profile: measured_costs(args, profile) for profile in args.profiles}
    detection(args, policy, costs[args.profiles[0]][3])
    rng, sign = random.Random(args.seed + 1), keyed(b"validator-secret")
    shares = [honest_share(policy, rng, sign, args.warmup, args.span) for _ in range(args.honest)]
    early, late = statistics.mean(s[0] for s in shares), statistics.mean(s[1] for s in shares)
    print(f"honest workers: mean share of full checks {early:.4f} over their first {args.warmup} submissions, "
          f"{late:.4f} over the next {args.span} (floor {policy.min_share})")
    for profile, (worker_s, full_s, light_s, rollouts) in costs.items():
        print(f"profile {profile} ({rollouts} rollouts per submission, {args.threads} thread(s)), process CPU s per submission: "
              f"worker {worker_s:.4f}, full check {full_s:.4f} (1/{worker_s / full_s:.1f}), light check {light_s:.4f} (1/{worker_s / light_s:.0f})")
        for label, share in (("every submission checked in full", 1.0), (f"during warm-up (share {early:.3f})", early),
                             (f"after warm-up (share {late:.4f})", late)):
            per = share * full_s + (1 - share) * light_s
            print(f"  ratio validator CPU per accepted rollout / worker's, {label}: {per / worker_s:.4f} = 1/{worker_s / per:.1f}"
                  + (f" (goal ≤ 1/20: {'met' if per / worker_s <= 1 / 20 else 'missed'})" if share == late else ""))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
