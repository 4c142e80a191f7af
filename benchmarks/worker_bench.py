"""Worker benchmark: decode throughput of the TransformersEngine vs ``model.generate``, and TOPLOC overhead.

Both sides sample (temperature 1, top-p 1) from the same randomly initialised Qwen2 with the
same batch and completion length; EOS is disabled on both sides (the engine's EOS id is set to a
token the gate never allows, ``generate`` gets no EOS id), so every sequence decodes exactly
``--new-tokens`` tokens and the token counts are equal. Time is process CPU time on CPU (damps
machine load; the model is single-threaded unless ``--threads``) and wall time on CUDA.

Prints tokens/s of each, and of the engine with ``static_decode`` off (the same loop decoding
through transformers' own forward and growing cache, as before ``node/engine/static_decode.py``),
the spread of the repeats, the engine/generate ratio (goal ≥ 1.5× at the default small shape,
≥ 1.0× at the 0.5B profile), the share of :func:`protocol.sampling.sample` in the engine's decode
time (goal ≤ 5 %), the share of :func:`protocol.toploc.build_proofs` time in generation + proof
time (goal ≤ 2 %), and the sampler's cost per decode step on the model's own next-token logits,
for a random and a ``peaked`` model side by side, one row per sampling rule.

``--compare-rules`` instead times the engine's decode under every rule of
:data:`protocol.sampling.RULES` (``icdf-v1``, ``gumbel-v2``), interleaved in one run: ms per decode
step, the sampler's ms per step (``sample`` and, for ``icdf-v1``, the ``uniforms`` the loop computes
ahead) and its share of decode, each rule against ``icdf-v1``.

Usage::

    python benchmarks/worker_bench.py [--hidden 256 --layers 4 --vocab 4096 --batch 16 --new-tokens 128]
    python benchmarks/worker_bench.py --profile qwen2.5-0.5b --layers 4 --batch 8 --repeats 1
    python benchmarks/worker_bench.py --compare-rules [--profile qwen2.5-0.5b --layers 2 --batch 4 --new-tokens 64]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiles import DEFAULT_PEAK_SCALE, PROFILES, QWEN25_05B, build_profile_model
from node.engine.base import SamplingParams
from node.engine.hf import TransformersEngine
from protocol import sampling, toploc
from protocol.models import build_model, embedded_config, embedded_tokenizer


def sampler_table(variants: dict[str, torch.Tensor], repeats: int) -> None:
    """Per-step cost of each sampling rule on captured ``[B, V]`` logits, side by side (CPU ms, the minimum of
    ``repeats``; the EOS gate off, ``icdf-v1``'s uniforms computed inside ``sample``)."""
    print(f"{'sampler on the model logits':34}" + "".join(f"{k + ' ms/step':>22}" for k in variants))
    best: dict[str, list[float]] = {}
    for rule in sampling.RULES:
        for logits in variants.values():
            b = logits.shape[0]
            seeds, pos = torch.arange(1, b + 1, dtype=torch.int64), torch.full((b,), 7, dtype=torch.int64)
            sampling.sample(logits, seeds, pos, rule=rule)
            out = math.inf
            for _ in range(repeats):
                t0 = time.process_time()
                sampling.sample(logits, seeds, pos, rule=rule)
                out = min(out, time.process_time() - t0)
            best.setdefault(rule, []).append(out)
        print(f"{rule:34}" + "".join(f"{x * 1e3:22.2f}" for x in best[rule]))
    base = best[sampling.RULE_ICDF]
    for rule in sampling.RULES:
        if rule != sampling.RULE_ICDF:
            print(f"{rule + ' / ' + sampling.RULE_ICDF:34}" + "".join(f"{x / max(y, 1e-9):21.2f}x" for x, y in zip(best[rule], base)))


def compare_rules(engine: TransformersEngine, prompts: list[list[int]], seeds: list[int], args: argparse.Namespace,
                  clock: Callable[[], float]) -> None:
    """The engine's decode under every rule of :data:`protocol.sampling.RULES`, interleaved ``args.repeats`` times (median):
    seconds per run, ms per decode step, the sampler's ms per step and share of decode, and each against ``icdf-v1``.

    The sampler's time counts :func:`protocol.sampling.sample` and :func:`protocol.sampling.uniforms` (``icdf-v1``'s decode
    loop computes the uniforms of 64 positions per call, outside ``sample``); EOS gated off as in the main table."""
    inner_sample, inner_uniforms = sampling.sample, sampling.uniforms
    spent = [0.0]

    def timed(fn: Callable[..., object]) -> Callable[..., object]:
        def run(*a: object, **k: object) -> object:
            t0 = clock()
            out = fn(*a, **k)
            spent[0] += clock() - t0
            return out
        return run

    runs: dict[str, list[tuple[float, float]]] = {rule: [] for rule in sampling.RULES}
    for i in range(args.repeats + 1):  # the first round is warm-up
        for rule in sampling.RULES:
            params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, eos_id=0, min_eos_prob=1.0, rule=rule)
            spent[0] = 0.0
            sampling.sample, sampling.uniforms = timed(inner_sample), timed(inner_uniforms)  # type: ignore[assignment]
            try:
                t0 = clock()
                gens = engine.generate(prompts, seeds, params)
                dt = clock() - t0
            finally:
                sampling.sample, sampling.uniforms = inner_sample, inner_uniforms  # type: ignore[assignment]
            assert all(len(x.completion_ids) == args.new_tokens for x in gens)
            if i:
                runs[rule].append((dt, spent[0]))
    unit = "CPU s" if args.device == "cpu" else "s"
    steps = args.new_tokens
    print(f"rules compared on the engine's decode: batch {args.batch}, {steps} decode steps per run, median of {args.repeats} "
          f"(interleaved), load average {os.getloadavg()[0]:.1f}")
    print(f"{'rule':12}{'engine ' + unit:>14}{'ms / decode step':>18}{'sampler ms / step':>19}{'sampler share':>15}"
          f"{'step vs icdf':>14}{'sampler vs icdf':>17}")
    med = {rule: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for rule, v in runs.items()}
    e0, s0 = med[sampling.RULE_ICDF]
    for rule, (e, smp) in med.items():
        print(f"{rule:12}{e:14.3f}{1e3 * e / steps:18.2f}{1e3 * smp / steps:19.2f}{100 * smp / e:14.2f}%{e / e0:13.2f}x{smp / max(s0, 1e-9):16.2f}x")


def _clock(device: str) -> Callable[[], float]:
    if device == "cuda":

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.process_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    ap.add_argument("--batch", type=int, default=16, help="sequences per batch")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (equal for all sequences)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", choices=PROFILES, default=None, help="realistic shape (benchmarks/profiles.py); --layers still applies")
    ap.add_argument("--peaked", type=float, default=0.0, help="scale the logits by this (0: random weights, flat logits)")
    ap.add_argument("--rule", choices=sampling.RULES, default=sampling.DEFAULT_RULE, help="the engine's sampling rule")
    ap.add_argument("--sampler-repeats", type=int, default=5, help="samples per variant in the sampler table (minimum reported); 0: skip")
    ap.add_argument("--compare-rules", action="store_true",
                    help="time the engine's decode under every sampling rule, interleaved (instead of engine vs model.generate)")
    args, _ = ap.parse_known_args()
    if args.profile:
        ap.set_defaults(layers=QWEN25_05B["layers"], vocab=QWEN25_05B["vocab"], hidden=QWEN25_05B["hidden"], new_tokens=256, batch=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = _clock(args.device)

    if args.profile:
        model = build_profile_model(args.layers, peaked=args.peaked).to(args.device)
        label = f"{args.profile} shape, {args.layers} layers" + (f", peaked ×{args.peaked:g}" if args.peaked else ", random weights")
    else:
        model = build_model(embedded_config(args.vocab, hidden_size=args.hidden, layers=args.layers), seed=0).to(args.device)
        if args.peaked:
            with torch.no_grad():
                model.model.norm.weight.mul_(args.peaked)
        label = f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}" + (f", peaked ×{args.peaked:g}" if args.peaked else "")
    tok = embedded_tokenizer()
    engine = TransformersEngine(model, tok, device=args.device, max_batch=args.batch)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    prompt_lists = prompts.tolist()
    seeds = list(range(1, args.batch + 1))
    # eos_id = pad (0) with min_eos_prob 1.0: the gate never admits it, so no sequence stops early.
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, eos_id=0, min_eos_prob=1.0, rule=args.rule)
    n_tokens = args.batch * args.new_tokens

    def run_engine(static: bool = True) -> float:
        engine.static_decode = static
        t0 = clock()
        gens = engine.generate(prompt_lists, seeds, params)
        dt = clock() - t0
        engine.static_decode = True
        assert all(len(x.completion_ids) == args.new_tokens for x in gens)
        return dt

    ids = prompts.to(args.device)
    attn = torch.ones_like(ids)
    if args.compare_rules:
        print(f"model: {label}; device {args.device}, {args.threads} thread(s)")
        compare_rules(engine, prompt_lists, seeds, args, clock)
        if args.sampler_repeats > 0 and args.device == "cpu":
            sampler_variants(model, ids, args)
        return

    def run_generate() -> float:
        t0 = clock()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0,
            )
        dt = clock() - t0
        assert out.shape[1] == args.prompt_len + args.new_tokens
        return dt

    # time spent inside the sampler during the engine's decode (same clock)
    sample_s = [0.0]
    inner_sample = sampling.sample

    def timed_sample(*a: object, **k: object) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = clock()
        out = inner_sample(*a, **k)  # type: ignore[arg-type]
        sample_s[0] += clock() - t0
        return out

    gens = engine.generate(prompt_lists, seeds, params)  # warm-up (and rows for the proof timing)
    run_generate()
    run_engine(static=False)
    t_engine, t_generate, t_sample, t_hf = [], [], [], []
    for _ in range(args.repeats):  # interleave so drifting machine load hits all alike
        sample_s[0] = 0.0
        sampling.sample = timed_sample  # type: ignore[assignment]
        try:
            t_engine.append(run_engine())
        finally:
            sampling.sample = inner_sample  # type: ignore[assignment]
        t_sample.append(sample_s[0] / t_engine[-1])
        t_generate.append(run_generate())
        t_hf.append(run_engine(static=False))
    e_s, g_s, hf_s = statistics.median(t_engine), statistics.median(t_generate), statistics.median(t_hf)
    spread = {k: f"{min(v) / statistics.median(v):.2f}–{max(v) / statistics.median(v):.2f}" for k, v in
              (("engine", t_engine), ("generate", t_generate), ("hf", t_hf))}

    t_proof = []
    for _ in range(args.repeats):
        t0 = time.process_time()
        for x in gens:
            toploc.build_proofs(x.hidden)
        t_proof.append(time.process_time() - t0)
    p_s = statistics.median(t_proof)

    unit = "CPU s" if args.device == "cpu" else "s"
    goal = 1.0 if args.profile else 1.5
    share = statistics.median(t_sample)
    print(f"model: {label}; device {args.device}, {args.threads} thread(s); engine rule {args.rule}")
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens ({n_tokens} tokens per run), median of {args.repeats}")
    print(f"TransformersEngine.generate : {e_s:7.3f} {unit}  {n_tokens / e_s:9.1f} tok/s  (runs within ×{spread['engine']} of the median)")
    print(f"  same, transformers decode : {hf_s:7.3f} {unit}  {n_tokens / hf_s:9.1f} tok/s  (×{spread['hf']}; static_decode off: "
          f"transformers' forward and cache per step)")
    print(f"model.generate (sampling)   : {g_s:7.3f} {unit}  {n_tokens / g_s:9.1f} tok/s  (×{spread['generate']})")
    print(f"ratio engine / generate     : {g_s / e_s:7.2f}x  (goal >= {goal}x: {'met' if g_s / e_s >= goal else 'missed'}); "
          f"transformers decode / generate {g_s / hf_s:.2f}x")
    print(f"sampler share of decode     : {100 * share:7.2f}%  (goal <= 5%: {'met' if share <= 0.05 else 'missed'})")
    print(f"TOPLOC build_proofs         : {p_s:7.3f} CPU s for {len(gens)} completions "
          f"({-(-args.new_tokens // 32)} proofs each); share of generation+proofs {100 * p_s / (e_s + p_s):.2f}% (goal <= 2%)")
    if args.sampler_repeats > 0 and args.device == "cpu":
        sampler_variants(model, ids, args)


def sampler_variants(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> None:
    """The sampler table on the prompts' next-token logits, from this model and from a peaked copy of its head."""
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[:, -1]  # [B, H], final-norm output
        flat = model.lm_head(h).float()
        scale = args.peaked or DEFAULT_PEAK_SCALE
        other = flat * (scale if not args.peaked else 1.0 / scale)
    variants = {"peaked": flat, "random": other} if args.peaked else {"random": flat, f"peaked x{scale:g}": other}
    for k, v in variants.items():
        pmax = torch.softmax(v.double(), -1).amax(-1).median()
        print(f"  {k}: median top-token probability {float(pmax):.3g}")
    sampler_table(variants, args.sampler_repeats)


if __name__ == "__main__":
    main()
