"""Validator seconds per submission vs the worker's seconds to generate it, and the validator against its floor.

Same hardware, same model, same submission: a worker builds it with the honest code
(:func:`node.worker.rollouts.build_submission`: batched decode with TOPLOC capture, proofs,
rewards, signature), then :class:`validator.pipeline.SubmissionChecker` judges it (task
derivation, one batched prefill, TOPLOC verification, sampling replay, log-probs, rewards).

The model is a Qwen2 with random weights at a realistic shape for a CPU (hidden 384, 4 layers,
vocab 4096 by default) with a word-level tokenizer of the same vocabulary. EOS is disabled
(``toploc.eos_min_prob = 1``: the sampler never draws it), so every completion runs to
``--max-tokens``: generation is decode-bound as in real RL rollouts, validation is one prefill.

``--profile qwen2.5-0.5b`` uses the Qwen2.5-0.5B shape with bf16-rounded random weights and a
locally trained byte-level BPE tokenizer (``benchmarks/profiles.py``; ``--layers`` overrides the
24 layers); ``--peaked S`` scales the logits by S (a sharp distribution instead of the flat one
of random weights). ``--load N`` runs N CPU-bound processes beside the measurement (a validator
sharing its machine). From the same run it prints:

* ``ratio sampling check / prefill`` (goal ≤ 1/4): the replay and log-prob checks against the
  batched prefill including every rollout's LM head;
* ``ratio validator / prefill`` (goal ≤ 1.25: everything besides the prefill — derivation, TOPLOC,
  sampling, rewards — at most a quarter of it): the validator against its floor;
* ``floor prefill / decode``: the validator's prefill against the worker's decode of the same
  tokens. On a CPU both are compute-bound, so validator / worker cannot fall below this; on a GPU
  decode is memory-bound and the floor is far lower (goal there: validator / worker ≤ 1/20);
* ``ratio validator / worker`` in wall and (on the CPU) process CPU seconds: wall time on a shared
  machine counts the time either side waited for a core, and the two sides suffer load differently
  (the validator's prefill is compute-bound, the worker's decode streams the weights every step);
* with ``--threads`` > 1, ``sampling check on N threads vs 1 thread``: each measured submission is
  also checked with the sampling check on every thread (the pipeline's default is one thread,
  ``SubmissionChecker(replay_threads=1)``), interleaved, so the two are compared on the same logits.

``--rule gumbel-v2`` needs a logit replay rule: ``--replay-rule`` defaults to ``logit-bound-v2`` for it
(``eps-v1`` for ``icdf-v1``), with ``--logit-bound`` δ. ``--compare-rules`` builds and checks the same
submissions (same worker, tasks and counters) under every sampling rule, interleaved, all under
``--replay-rule`` (default ``logit-bound-v2``: the bf16 setting ``gumbel-v2`` is for), and prints each
rule's table and then the rules side by side: the worker's decode, the validator's sampling check,
its prefill, sampling / prefill and each rule's sampling check against ``icdf-v1``'s.

Example::

    python benchmarks/validator_bench.py --max-tokens 192 --threads 2 --repeats 3
    python benchmarks/validator_bench.py --hidden 896 --layers 4 --heads 16 --vocab 151936 --max-tokens 128 --tasks 2 --group 4 --repeats 1
    python benchmarks/validator_bench.py --hidden 896 --layers 4 --heads 16 --vocab 151936 --max-tokens 128 --tasks 2 --group 4 --repeats 1 --load 2
    python benchmarks/validator_bench.py --profile qwen2.5-0.5b --layers 4 --tasks 2 --group 4 --repeats 1 --peaked 12
    python benchmarks/validator_bench.py --compare-rules --profile qwen2.5-0.5b --layers 2 --tasks 2 --group 4 --max-tokens 128 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import PROFILES, QWEN25_05B, bpe_tokenizer, build_profile_model
from node.engine.hf import TransformersEngine
from node.worker.rollouts import BuildStats, build_submission
from protocol import sampling
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.models import EMBEDDED_CHARS, build_model
from protocol.runspec import (
    LOGIT_BOUND_RULES,
    REPLAY_RULE_EPS,
    REPLAY_RULE_LOGIT_BOUND_V2,
    REPLAY_RULES,
    DataSpec,
    ModelSpec,
    RLSpec,
    RunInfo,
    RunSpec,
    SamplingSpec,
    ToplocSpec,
)
from validator.pipeline import SubmissionChecker


def make_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of exactly ``vocab_size`` ids: pad, eos, unk, the printable
    characters (prompts are spelled in them), then ``<tNNNN>`` filler tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in EMBEDDED_CHARS:
        vocab[c] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


def make_model(vocab_size: int, hidden: int, layers: int, heads: int, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096, tie_word_embeddings=True,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )
    return build_model(cfg, seed=seed)


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes (a Python busy loop each) running until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], env={**os.environ, "OMP_NUM_THREADS": "1"})
             for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=384, help="hidden size (≥ 128, the TOPLOC top-k)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size, tokens")
    p.add_argument("--max-tokens", type=int, default=192, help="completion length, tokens (EOS is disabled)")
    p.add_argument("--tasks", type=int, default=4, help="tasks per submission")
    p.add_argument("--group", type=int, default=4, help="rollouts per task")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (worker and validator alike)")
    p.add_argument("--max-batch", type=int, default=64, help="worker engine: sequences per decode batch")
    p.add_argument("--repeats", type=int, default=3, help="submissions measured (after one warm-up)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    p.add_argument("--profile", choices=PROFILES, default=None, help="realistic shape (benchmarks/profiles.py); --layers still applies")
    p.add_argument("--peaked", type=float, default=0.0, help="scale the logits by this (0: random weights, flat logits)")
    p.add_argument("--rule", choices=sampling.RULES, default=sampling.DEFAULT_RULE, help="the run's sampling rule")
    p.add_argument("--load", type=int, default=0, help="CPU-bound processes running beside the measurement (a shared machine)")
    p.add_argument("--replay-rule", choices=REPLAY_RULES, default=None,
                   help="the run's replay rule (default eps-v1 for icdf-v1, logit-bound-v2 for gumbel-v2 and --compare-rules)")
    p.add_argument("--logit-bound", type=float, default=0.7, help="δ of the logit replay rules, nats (the embedded base's measured δ)")
    p.add_argument("--compare-rules", action="store_true", help="the same submissions under every sampling rule, interleaved")
    args, _ = p.parse_known_args()
    if args.profile:
        p.set_defaults(layers=QWEN25_05B["layers"], vocab=QWEN25_05B["vocab"], hidden=QWEN25_05B["hidden"], heads=QWEN25_05B["heads"],
                       max_tokens=256)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    if args.replay_rule is None:
        args.replay_rule = REPLAY_RULE_LOGIT_BOUND_V2 if args.compare_rules or args.rule == sampling.RULE_GUMBEL else REPLAY_RULE_EPS
    worker = NodeKey.from_seed(b"w" * 32)
    spec = make_spec(args, args.rule)
    tasks = resolve_tasks("embedded").train
    if args.profile:
        tok = bpe_tokenizer(args.vocab)
        model = build_profile_model(args.layers, peaked=args.peaked).to(args.device)
    else:
        tok = make_tokenizer(args.vocab)
        model = make_model(args.vocab, args.hidden, args.layers, args.heads, seed=0).to(args.device)
        if args.peaked:
            with torch.no_grad():
                model.model.norm.weight.mul_(args.peaked)
    engine = TransformersEngine(model, tok, device=args.device, max_batch=args.max_batch)
    if args.compare_rules:
        compare(args, worker, engine, tok, tasks, model)
        return
    checker = SubmissionChecker(spec, tasks, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False)
    # the same pipeline with the sampling check on all the process's threads, checked on the same submissions
    all_threads = SubmissionChecker(spec, tasks, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False,
                                    replay_threads=None) if args.threads > 1 else None

    rows = []
    cpu = []  # (worker, validator) process CPU seconds: what each side costs, damped against other jobs' load
    alt: list[tuple[Any, Any]] = []  # (the process's threads, one thread) results of the same submission
    with cpu_load(args.load):
        measure(args, spec, worker, engine, tok, tasks, checker, rows, cpu, all_threads, alt)
    report(args, model, rows, cpu, alt)


def make_spec(args: argparse.Namespace, rule: str) -> RunSpec:
    """The benchmark's run spec under sampling rule ``rule`` and ``args.replay_rule`` (δ ``args.logit_bound`` for the logit rules)."""
    bound = {"replay_logit_bound": args.logit_bound} if args.replay_rule in LOGIT_BOUND_RULES else {}
    return RunSpec(
        run=RunInfo(coordinator=NodeKey.from_seed(b"c" * 32).peer_id, seed=1),
        model=ModelSpec(hidden_size=args.hidden),
        data=DataSpec(tasks_per_submission=args.tasks),
        sampling=SamplingSpec(max_tokens=args.max_tokens, temperature=args.temperature, rule=rule),
        toploc=ToplocSpec(eos_min_prob=1.0, replay_rule=args.replay_rule, **bound),  # EOS never sampled: every completion is max_tokens long
        rl=RLSpec(group_size=args.group),
    )


def compare(args: argparse.Namespace, worker: NodeKey, engine: TransformersEngine, tok: Any, tasks: list[Any], model: torch.nn.Module) -> None:
    """Build and check the same submissions under every rule of :data:`protocol.sampling.RULES`, interleaved (counter by
    counter; counter 0 is warm-up), then print each rule's table and the rules side by side."""
    specs = {rule: make_spec(args, rule) for rule in sampling.RULES}
    checkers = {rule: SubmissionChecker(spec, tasks, tok, lambda s: model, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False)
                for rule, spec in specs.items()}
    rows: dict[str, list[Any]] = {rule: [] for rule in specs}
    cpu: dict[str, list[tuple[float, float]]] = {rule: [] for rule in specs}
    with cpu_load(args.load):
        for counter in range(args.repeats + 1):
            for rule, spec in specs.items():
                measure(args, spec, worker, engine, tok, tasks, checkers[rule], rows[rule], cpu[rule], counters=range(counter, counter + 1))
    for rule in specs:
        print(f"--- sampling rule {rule}, replay rule {args.replay_rule} (δ {args.logit_bound:g} nats)")
        report(argparse.Namespace(**{**vars(args), "rule": rule}), model, rows[rule], cpu[rule])
    med = statistics.median
    print(f"--- the rules side by side (same submissions, interleaved; replay rule {args.replay_rule}; "
          f"load average {min(r[3] for v in rows.values() for r in v):.1f} … {max(r[3] for v in rows.values() for r in v):.1f})")
    print(f"{'rule':12}{'decode s':>10}{'ms/step':>9}{'prefill s':>11}{'sampling s':>12}{'sampling/prefill':>18}{'validator/prefill':>19}"
          f"{'sampling vs icdf':>18}{'ms/token':>10}")
    tokens = args.tasks * args.group * args.max_tokens
    base = med(r[2].timings.get("sampling", 0.0) for r in rows[sampling.RULE_ICDF])
    for rule, rs in rows.items():
        gen = med(r[1].generate_s for r in rs)
        pre = max(med(r[2].timings.get("prefill", 0.0) for r in rs), 1e-9)
        smp = med(r[2].timings.get("sampling", 0.0) for r in rs)
        val = med(r[2].seconds for r in rs)
        steps = -(-args.tasks * args.group // args.max_batch) * args.max_tokens
        print(f"{rule:12}{gen:10.3f}{1e3 * gen / steps:9.2f}{pre:11.3f}{smp:12.3f}{smp / pre:18.4f}{val / pre:19.4f}"
              f"{smp / max(base, 1e-9):17.2f}x{1e3 * smp / tokens:10.3f}")


def measure(args: argparse.Namespace, spec: RunSpec, worker: NodeKey, engine: TransformersEngine, tok: Any, tasks: list[Any],
            checker: SubmissionChecker, rows: list[Any], cpu: list[tuple[float, float]], all_threads: SubmissionChecker | None = None,
            alt: list[tuple[Any, Any]] | None = None, counters: range | None = None) -> None:
    """Build and check ``repeats + 1`` submissions (the first is warm-up), appending to ``rows`` and ``cpu``;
    with ``all_threads`` (the sampling check on every thread; ``checker``'s on one), each measured
    submission is also checked by it (before the main check on odd counters, after on even ones) and
    both results go to ``alt``. ``counters``: only these submission counters (counter 0 is the warm-up)."""
    for counter in counters if counters is not None else range(args.repeats + 1):
        stats = BuildStats()
        t0, c0 = time.perf_counter(), time.process_time()
        blob = build_submission(spec, spec.run_id, worker, engine, tok, tasks, 0, counter, stats=stats)
        worker_s, worker_cpu = time.perf_counter() - t0, time.process_time() - c0
        env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
        other = all_threads.check(env) if all_threads is not None and counter % 2 else None
        c0 = time.process_time()
        result = checker.check(env)
        validator_cpu = time.process_time() - c0
        if all_threads is not None and other is None:
            other = all_threads.check(env)
        if not result.accepted:
            raise SystemExit(f"honest submission rejected: {result.reason} {result.evidence}")
        if counter:  # the first is warm-up
            rows.append((worker_s, stats, result, os.getloadavg()[0]))
            cpu.append((worker_cpu, validator_cpu))
            if alt is not None and other is not None:
                alt.append((other, result))


def report(args: argparse.Namespace, model: torch.nn.Module, rows: list[Any], cpu: list[tuple[float, float]],
           alt: list[tuple[Any, Any]] | None = None) -> None:
    """Print the side-by-side table and the ratios."""
    n_params = sum(x.numel() for x in model.parameters())
    seqs = args.tasks * args.group
    shape = f"{args.profile} shape, {args.layers} layers" if args.profile else f"Qwen2 hidden {args.hidden}, {args.layers} layers"
    kind = f"peaked ×{args.peaked:g}" if args.peaked else "random weights"
    print(f"model: {shape}, vocab {args.vocab} ({n_params / 1e6:.1f} M params, {kind}), "
          f"device {args.device}, {args.threads} threads, sampling rule {args.rule}, replay rule {args.replay_rule}, {args.load} CPU-bound processes beside it")
    loads = [r[3] for r in rows]
    print(f"load average (1 min) after each measured submission: {min(loads):.1f} … {max(loads):.1f}")
    print(f"submission: {seqs} rollouts × {args.max_tokens} tokens ({seqs * args.max_tokens} completion tokens), "
          f"worker max_batch {args.max_batch}; {args.repeats} measured")
    med = statistics.median
    w_total = med(r[0] for r in rows)
    w_gen = med(r[1].generate_s for r in rows)
    w_proof = med(r[1].proof_s for r in rows)
    w_reward = med(r[1].reward_s for r in rows)
    v_total = med(r[2].seconds for r in rows)
    stages = {k: med(r[2].timings.get(k, 0.0) for r in rows) for k in rows[0][2].timings}
    print(f"{'':24}{'worker s':>12}{'validator s':>14}")
    print(f"{'total / submission':24}{w_total:12.3f}{v_total:14.3f}")
    w_cpu, v_cpu = med(c[0] for c in cpu), med(c[1] for c in cpu)
    print(f"{'  same, CPU seconds':24}{w_cpu:12.3f}{v_cpu:14.3f}")
    print(f"{'  generate (decode)':24}{w_gen:12.3f}")
    print(f"{'  proofs':24}{w_proof:12.3f}")
    print(f"{'  rewards':24}{w_reward:12.3f}")
    for k, v in stages.items():
        print(f"{'  ' + k:24}{'':12}{v:14.3f}")
    ratio = v_total / w_total
    if args.device == "cuda":
        print(f"ratio validator / worker: {ratio:.4f} = 1/{1 / ratio:.1f} (goal ≤ 1/20 on a GPU: {'met' if ratio <= 1 / 20 else 'missed'})")
    else:
        print(f"ratio validator / worker: {ratio:.4f} = 1/{1 / ratio:.1f} (on a CPU floored by prefill / decode, below)")
        spread = [c[1] / c[0] for c in cpu]
        r_cpu = v_cpu / w_cpu
        print(f"ratio in CPU seconds    : {r_cpu:.4f} = 1/{1 / r_cpu:.1f}; per submission 1/{1 / max(spread):.1f} … 1/{1 / min(spread):.1f}")
    prefill = max(stages.get("prefill", 0.0), 1e-9)
    share = stages.get("sampling", 0.0) / prefill
    print(f"ratio sampling check / prefill: {share:.4f} (goal ≤ 1/4: {'met' if share <= 0.25 else 'missed'})")
    floor = v_total / prefill
    print(f"ratio validator / prefill: {floor:.4f} (goal ≤ 1.25, everything besides the prefill ≤ 25 % of it: "
          f"{'met' if floor <= 1.25 else 'missed'})")
    print(f"floor prefill / decode: {prefill / max(w_gen, 1e-9):.4f} = 1/{w_gen / prefill:.1f} (validator / worker cannot fall below this "
          f"where both are compute-bound)")
    if alt:  # the same submissions checked with the sampling check on every thread (the table: on one, the default), interleaved
        def ratio_of(results: list[Any]) -> tuple[float, float, float]:
            samp, pre = med(r.timings.get("sampling", 0.0) for r in results), max(med(r.timings.get("prefill", 0.0) for r in results), 1e-9)
            return samp, samp / pre, med(r.seconds for r in results) / pre

        (s_n, r_n, v_n), (s_1, r_1, v_1) = ratio_of([a[0] for a in alt]), ratio_of([a[1] for a in alt])
        print(f"sampling check on {args.threads} threads vs 1 thread (same submissions, interleaved): {s_n:.3f} s vs {s_1:.3f} s "
              f"({s_1 / max(s_n, 1e-9):.2f}x); ratio sampling check / prefill {r_n:.4f} vs {r_1:.4f}; "
              f"validator / prefill {v_n:.4f} vs {v_1:.4f}")


if __name__ == "__main__":
    main()
