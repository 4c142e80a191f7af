"""Honest false rejections of the real validator pipeline at scale, and the margin of every threshold.

Honest workers generate submissions with the real worker code (:func:`node.worker.rollouts.
build_submission`) across every combination of

* decode batch 1 / 8 / 64 sequences (``TransformersEngine.max_batch``),
* 1 / 2 torch threads,
* KV cache on (the engine) / off (an honest worker that runs a full forward over prompt + tokens
  so far at every step, same sampler and capture),
* eager / sdpa attention,
* float32 / bfloat16 compute (the worker's copy of the policy in that dtype; the validator always
  float32, as ``intellect-node validate`` loads it),

and :class:`validator.pipeline.SubmissionChecker` judges every submission in full (one thread).
It prints ``honest false rejections: K / N (95 % upper bound U)`` over the N honest rollouts
(goal K = 0, U ≤ 3e-4; U is the one-sided Clopper–Pearson bound, a submission's rejection counted
against every one of its rollouts), then for each threshold the worst honest value, per compute
dtype, its margin (threshold / worst honest), and the nearest cheat: workers of the same compute
dtype that generate and prove with a perturbed copy of the policy (relative weight noise 1e-3,
1e-2, 3e-2), and the ``other-model`` adversary (a cheap model samples, the policy's prefill makes
the proofs), each statistic computed the pipeline's way on every rollout.

The policy is a random-weight Qwen2 (vocabulary 32,768, hidden 128, 2 layers) whose final norm is
scaled by ``--peaked`` (sharp next-token distributions, like a trained model's; ``0``: flat) and
whose EOS row of the (untied) LM head is set so that P(EOS) varies widely over positions, so
completions end both by EOS and by length. The float32 workers' run is the default spec (replay
rule ``eps-v1``); the bfloat16 workers' run uses replay rule ``logit-bound-v1`` with the stated
per-logit error ``--bf16-logit-bound`` (δ, nats) and raises the near-tie share and log-prob
tolerances (``--bf16-max-near-tie-fraction``, ``--bf16-logprob-max-abs``, ``--bf16-logprob-mean-abs``;
run spec ``toploc.*``, ``docs/toploc.md`` §6.2, §8), as a run whose workers decode in bf16 must.
Every worker's logits at each sampled position are captured as its sampler saw them, so the
table also prints the data δ is chosen from: each position's logit error against the validator,
``max_v |x'_v − x_v − s|`` at the best common shift ``s`` (half the range of ``x' − x``).

Example::

    python benchmarks/false_rejections.py                      # 48 configurations × 4 submissions × 64 rollouts
    python benchmarks/false_rejections.py --submissions 1 --max-tokens 8   # a quick look
    python benchmarks/false_rejections.py --dtypes bfloat16 --submissions 1   # the bf16 rows alone
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.validator_bench import make_tokenizer
from node.engine.base import SamplingParams
from node.engine.hf import TransformersEngine, seeds_tensor
from node.worker.adversary import build_dishonest_submission, perturbed_model
from node.worker.rollouts import build_submission
from protocol import sampling, toploc
from protocol.dataset import resolve_tasks
from protocol.envelope import Envelope, open_envelope
from protocol.identity import NodeKey
from protocol.inference import completion_rows, forward, head_logits, pad_left
from protocol.messages import Submission
from protocol.models import build_model
from protocol.rollout import unpack_f32, unpack_u32
from protocol.runspec import DataSpec, ModelSpec, RLSpec, RunInfo, RunSpec, SamplingSpec, ToplocSpec
from validator.pipeline import SubmissionChecker

EOS, PAD = 1, 0


class NoCacheEngine(TransformersEngine):
    """An honest worker without a KV cache: every step runs a full forward over each sequence's
    prompt + tokens so far (left-padded batch), then samples with the same rule and commits the
    final-norm row that produced the token, as the cached engine does."""

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Any]:
        from node.engine.base import Generation

        b, n_max = len(prompts), params.max_tokens
        seqs = [list(p) for p in prompts]
        seed_t = seeds_tensor(seeds, self.device)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
        active = list(range(b))
        for i in range(n_max):
            ids, mask, pos = (t.to(self.device) for t in pad_left([seqs[j] for j in active], self.pad_id))
            out = forward(self.model, ids, mask, pos, logits_positions=torch.tensor([ids.shape[1] - 1], device=self.device))
            tok, lp = sampling.sample(out.logits[:, -1].float(), seed_t[active], torch.full((len(active),), i, device=self.device),
                                      params.temperature, params.top_p, (params.eos_id,), params.min_eos_prob, params.rule)
            for k, j in enumerate(active):
                toks[j].append(int(tok[k]))
                lps[j].append(float(lp[k]))
                rows[j].append(out.hidden[k, -1].to(torch.bfloat16).cpu())
                seqs[j].append(int(tok[k]))
            active = [j for j in active if toks[j][-1] != params.eos_id]
            if not active:
                break
        return [Generation(completion_ids=torch.tensor(toks[j]), logprobs=torch.tensor(lps[j], dtype=torch.float32),
                           hidden=torch.stack(rows[j]), finish="eos" if toks[j][-1] == params.eos_id else "length") for j in range(b)]


def make_policy(args: argparse.Namespace) -> torch.nn.Module:
    """The float32 policy (sdpa attention): random Qwen2, sharpened, with a varied P(EOS)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=1024,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if args.peaked:
            model.model.norm.weight.mul_(args.peaked)
        w = torch.randn(args.hidden, generator=g)
        scale = args.peaked or 1.0
        # logit_EOS = h·w: h has RMS ≈ `scale`, so EOS's logit spreads like the others' maxima and P(EOS) varies widely
        model.lm_head.weight[EOS] = args.eos_scale * w / w.norm() / scale
    policy: torch.nn.Module = model.eval()
    return policy


def worker_copy(policy: torch.nn.Module, attn: str, dtype: torch.dtype) -> torch.nn.Module:
    """The honest worker's copy of the float32 policy, in ``dtype`` with attention ``attn`` (eager, sdpa)."""
    model: Any = copy.deepcopy(policy).to(dtype)
    model.set_attn_implementation(attn)
    copy_: torch.nn.Module = model.eval()
    return copy_


BF16_DEFAULTS = {"replay_logit_bound": 1.0, "max_near_tie_fraction": 0.5, "logprob_max_abs": 2.0, "logprob_mean_abs": 0.5}
"""The bf16 workers' run spec ``toploc.*`` under replay rule ``logit-bound-v1`` (the float32 run uses the
defaults), chosen from this benchmark's bf16 rows (``docs/toploc.md`` §10; runs measured with
``logit-bound-v2`` set theirs with ``spec init --measure-precision``): δ = 1.0 nats
(the largest honest bf16 logit error: 0.79 over the 83,535 positions of 10,752 rollouts, 99.9 %
quantile 0.67); the per-token log-prob bound 2δ, the most logits within δ can move a log-prob."""


def run_spec(args: argparse.Namespace, dtype: torch.dtype) -> RunSpec:
    toploc_spec = ToplocSpec() if dtype == torch.float32 else ToplocSpec(
        logprob_max_abs=args.bf16_logprob_max_abs, logprob_mean_abs=args.bf16_logprob_mean_abs, replay_rule="logit-bound-v1",
        replay_logit_bound=args.bf16_logit_bound, max_near_tie_fraction=args.bf16_max_near_tie_fraction)
    return RunSpec(run=RunInfo(coordinator=NodeKey.from_seed(b"c" * 32).peer_id, seed=11), model=ModelSpec(hidden_size=args.hidden),
                   data=DataSpec(tasks_per_submission=args.tasks), sampling=SamplingSpec(max_tokens=args.max_tokens, temperature=args.temperature),
                   toploc=toploc_spec, rl=RLSpec(group_size=args.group))


@dataclass
class Stats:
    """Per-rollout values of every thresholded statistic, computed as the pipeline computes them."""

    mismatches: list[float] = field(default_factory=list)  # TOPLOC sign/exponent mismatches, worst chunk
    mant_mean: list[float] = field(default_factory=list)  # TOPLOC mean mantissa error, worst chunk
    mant_median: list[float] = field(default_factory=list)  # TOPLOC upper-median mantissa error, worst chunk
    gap: list[float] = field(default_factory=list)  # largest replay gap of a token that differs (0 if none): probability units (eps-v1), nats (logit-bound-v1)
    logit_err: list[float] = field(default_factory=list)  # largest logit error of the worker at a sampled position, nats, up to a common shift
    tie_share: list[float] = field(default_factory=list)  # (d − 1) / T for d ≥ 1 differing tokens of T, else 0: passes iff < the share
    lp_max: list[float] = field(default_factory=list)  # max |reported − recomputed| log-prob, nats
    lp_mean: list[float] = field(default_factory=list)  # mean of the same over the completion
    top_p: list[float] = field(default_factory=list)  # the policy's top-token probability at each position (how peaked it is)
    eos_stops: int = 0
    tokens: int = 0

    def add(self, other: Stats) -> None:
        for name in ("mismatches", "mant_mean", "mant_median", "gap", "logit_err", "tie_share", "lp_max", "lp_mean", "top_p"):
            getattr(self, name).extend(getattr(other, name))
        self.eos_stops += other.eos_stops
        self.tokens += other.tokens


class SamplerLogits:
    """Captures the logits every worker's sampler sees, by (sequence seed, completion position): the
    worker side of the logit error (a context manager around :func:`protocol.sampling.sample`)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self._sample = sampling.sample

    def __enter__(self) -> Self:
        def spy(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *a: Any, **k: Any) -> Any:
            for i, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
                self.rows[(seed, pos)] = logits[i].detach().float().cpu().clone()
            return self._sample(logits, seeds, positions, *a, **k)

        sampling.sample = spy
        return self

    def __exit__(self, *exc: object) -> None:
        sampling.sample = self._sample


@torch.no_grad()
def statistics_of(spec: RunSpec, model: torch.nn.Module, env: Envelope[Submission], pad_id: int,
                  worker_logits: dict[tuple[int, int], torch.Tensor] | None = None) -> Stats:
    """Every rollout's statistics, from the validator's float32 prefill (TOPLOC, replay with no
    near-tie cap, log-probs), whether or not the pipeline would stop at an earlier check; with
    ``worker_logits`` (:class:`SamplerLogits`), each rollout's largest logit error too."""
    out = Stats()
    ros = env.body.rollouts
    comps = [unpack_u32(r.completion_ids) for r in ros]
    rows = completion_rows(model, [unpack_u32(r.prompt_ids) for r in ros], comps, pad_id)
    verdicts = toploc.verify_proofs_many([r.to(torch.bfloat16) for r in rows], [list(r.proofs) for r in ros],
                                         chunk_size=spec.toploc.chunk_size, topk=spec.toploc.topk)
    for res in verdicts:
        out.mismatches.append(max(r.mismatches for r in res))
        out.mant_mean.append(max(r.mant_err_mean for r in res))
        out.mant_median.append(max(r.mant_err_median for r in res))
    s = spec.sampling
    for ro, row, comp in zip(ros, rows, comps, strict=True):
        logits = head_logits(model, row)
        out.top_p.extend(torch.softmax(logits.double() / s.temperature, -1).amax(-1).tolist())
        if worker_logits is not None:
            worst = 0.0
            for i in range(len(comp)):
                d = worker_logits[(ro.seed, i)].double() - logits[i].double()  # [V]
                worst = max(worst, float(d.max() - d.min()) / 2)
            out.logit_err.append(worst)
        t = spec.toploc
        rep = sampling.replay_check(logits, comp, ro.seed, sampling.ReplayParams(temperature=s.temperature, top_p=s.top_p, eps=t.replay_eps, max_near_tie_fraction=1.0, eos_ids=(EOS,), min_eos_prob=t.eos_min_prob, eos_prob_slack=t.eos_prob_slack, replay_rule=t.replay_rule, logit_bound=t.replay_logit_bound), 0, overwrite=True)
        differs = rep.tokens.cpu() != torch.tensor(comp)
        out.gap.append(float(rep.gaps.cpu()[differs].max()) if bool(differs.any()) else 0.0)
        d = int(differs.sum())  # the rule allows ⌈share · T⌉ of T: d of them pass iff share > (d − 1) / T
        out.tie_share.append((d - 1) / len(comp) if d else 0.0)
        assert rep.logprobs is not None
        err = (torch.tensor(unpack_f32(ro.logprobs), dtype=torch.float64) - rep.logprobs.cpu()).abs()
        out.lp_max.append(float(err.max()))
        out.lp_mean.append(float(err.mean()))
        out.eos_stops += comp[-1] == EOS
        out.tokens += len(comp)
    return out


def upper_bound_95(k: int, n: int) -> float:
    """One-sided 95 % Clopper–Pearson upper bound of a binomial rate with k events in n trials."""
    if k >= n:
        return 1.0

    def cdf(p: float) -> float:  # P(X ≤ k)
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p))
                   for i in range(k + 1))

    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 0.05 else (lo, mid)
    return hi


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cheat_stats(args: argparse.Namespace, policy_cpu: torch.nn.Module, policy: torch.nn.Module, tok: Any, tasks: Any, dtype: torch.dtype,
                counter: int) -> tuple[dict[str, Stats], dict[str, list[str]], int]:
    """Each cheating kind's statistics and verdicts under the run of ``dtype`` (its workers compute in
    that dtype on ``args.device``; ``policy`` is the validator's float32 copy there)."""
    spec = run_spec(args, dtype)
    checker = SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False)
    stats: dict[str, Stats] = {}
    verdicts: dict[str, list[str]] = {}
    for name, scale in [(f"perturbed {s:g}", s) for s in (1e-3, 1e-2, 3e-2)] + [("other-model", None)]:
        st, reasons = Stats(), []
        model = worker_copy(policy_cpu if scale is None else perturbed_model(policy_cpu, scale, seed=5), "sdpa", dtype).to(args.device)
        engine = TransformersEngine(model, tok, device=args.device, max_batch=64)
        for _ in range(args.cheat_submissions):
            key = NodeKey.from_seed(bytes([counter % 251 + 1]) * 32)
            with SamplerLogits() as seen:
                if scale is None:  # the adversary's cheap model samples; it proves with the engine's (policy) model
                    blob = build_dishonest_submission("other-model", spec, spec.run_id, key, engine, tok, tasks, 0, counter)
                else:
                    blob = build_submission(spec, spec.run_id, key, engine, tok, tasks, 0, counter)
            counter += 1
            env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
            reasons.append(checker.check(env).reason)
            st.add(statistics_of(spec, policy, env, tok.pad_token_id, seen.rows))
        stats[name], verdicts[name] = st, reasons
    return stats, verdicts, counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32_768)
    ap.add_argument("--hidden", type=int, default=128, help="≥ 128, the TOPLOC top-k")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--peaked", type=float, default=40.0, help="final-norm scale: sharp next-token distributions (0: flat, random weights)")
    ap.add_argument("--eos-scale", type=float, default=40.0, help="norm of the EOS row of the LM head relative to the final-norm scale")
    ap.add_argument("--max-tokens", type=int, default=16, help="completion length limit, tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tasks", type=int, default=8, help="tasks per submission")
    ap.add_argument("--group", type=int, default=8, help="rollouts per task (tasks × group rollouts per submission: 64 fills batch 64)")
    ap.add_argument("--submissions", type=int, default=4, help="honest submissions per configuration (24 configurations per dtype)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"], help="the honest workers' compute dtypes")
    ap.add_argument("--cheat-submissions", type=int, default=2, help="submissions per cheating worker and dtype")
    ap.add_argument("--first-counter", type=int, default=0,
                    help="submission counter of the first honest submission: runs with different values check different submissions")
    ap.add_argument("--device", default="cpu", help="where the workers decode and the validator prefills (cpu, cuda)")
    ap.add_argument("--bf16-logit-bound", type=float, default=BF16_DEFAULTS["replay_logit_bound"],
                    help="run spec toploc.replay_logit_bound (δ, nats) of the bf16 workers' run (replay rule logit-bound-v1)")
    ap.add_argument("--bf16-max-near-tie-fraction", type=float, default=BF16_DEFAULTS["max_near_tie_fraction"],
                    help="run spec toploc.max_near_tie_fraction of the bf16 workers' run")
    ap.add_argument("--bf16-logprob-max-abs", type=float, default=BF16_DEFAULTS["logprob_max_abs"],
                    help="run spec toploc.logprob_max_abs of the bf16 workers' run")
    ap.add_argument("--bf16-logprob-mean-abs", type=float, default=BF16_DEFAULTS["logprob_mean_abs"],
                    help="run spec toploc.logprob_mean_abs of the bf16 workers' run")
    args = ap.parse_args()
    t_start, load_start = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(1)
    tok = make_tokenizer(args.vocab)
    tasks = resolve_tasks("embedded").train
    policy_cpu = make_policy(args)
    policy = copy.deepcopy(policy_cpu).to(args.device)  # the validator's float32 copy
    print(f"policy: Qwen2 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, final norm ×{args.peaked:g}; "
          f"{args.tasks} tasks × {args.group} rollouts × ≤ {args.max_tokens} tokens per submission; device {args.device}")
    worker_key = NodeKey.from_seed(b"w" * 32)
    honest: dict[str, Stats] = defaultdict(Stats)
    n_rollouts = rejected_rollouts = 0
    per_dtype: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # dtype -> [rejected rollouts, rollouts]
    rejections: list[str] = []
    counter = args.first_counter
    dtypes = [DTYPES[d] for d in args.dtypes]
    for batch, threads, kv, attn, dtype in itertools.product((1, 8, 64), (1, 2), (True, False), ("eager", "sdpa"), dtypes):
        spec = run_spec(args, dtype)
        checker = SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda w, c, sid: False)
        engine = (TransformersEngine if kv else NoCacheEngine)(worker_copy(policy, attn, dtype), tok, device=args.device, max_batch=batch)
        label = f"batch {batch:2d}, {threads} thread(s), KV cache {'on ' if kv else 'off'}, {attn:5s}, {str(dtype)[6:]}"
        t0, rejected_before = time.perf_counter(), len(rejections)
        for _ in range(args.submissions):
            torch.set_num_threads(threads)
            with SamplerLogits() as seen:
                blob = build_submission(spec, spec.run_id, worker_key, engine, tok, tasks, 0, counter)
            counter += 1
            torch.set_num_threads(1)
            env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
            result = checker.check(env)
            n = len(env.body.rollouts)
            n_rollouts += n
            per_dtype[str(dtype)[6:]][1] += n
            if not result.accepted:
                rejected_rollouts += n
                per_dtype[str(dtype)[6:]][0] += n
                rejections.append(f"{label}: {result.reason} {result.evidence}")
            honest[str(dtype)[6:]].add(statistics_of(spec, policy, env, tok.pad_token_id, seen.rows))
        print(f"  {label}: {args.submissions} submissions in {time.perf_counter() - t0:6.1f} s, "
              f"{'all accepted' if len(rejections) == rejected_before else f'{len(rejections) - rejected_before} REJECTED'}", flush=True)
    print(f"honest false rejections: {rejected_rollouts} / {n_rollouts} (95 % upper bound {upper_bound_95(rejected_rollouts, n_rollouts):.2g})")
    for name, (k, n) in per_dtype.items():
        print(f"  {name} workers' run: {k} / {n} (95 % upper bound {upper_bound_95(k, n):.2g})")
    for name, st in honest.items():
        print(f"  {name} workers: {len(st.lp_max)} rollouts, {st.tokens} tokens, {st.eos_stops} ended by EOS; the policy's top-token "
              f"probability at their positions: median {statistics.median(st.top_p):.3f}, lower quartile {statistics.quantiles(st.top_p, n=4)[0]:.3f}")
    for line in rejections[:20]:
        print(f"  rejected: {line[:300]}")

    cheats: dict[str, dict[str, Stats]] = {}
    for dtype in dtypes:
        cheats[str(dtype)[6:]], verdicts, counter = cheat_stats(args, policy_cpu, policy, tok, tasks, dtype, counter)
        print(f"cheating workers' verdicts, {str(dtype)[6:]} run: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in verdicts.items()))

    table = [  # (threshold, statistic, the run spec's field)
        ("TOPLOC mismatches per chunk (max)", "mismatches", "max_mismatches"),
        ("TOPLOC mantissa error mean (max)", "mant_mean", "max_mant_err_mean"),
        ("TOPLOC mantissa error median (max)", "mant_median", "max_mant_err_median"),
        ("replay gap of a differing token", "gap", "replay_eps"),
        ("worker's logit error at a position, nats", "logit_err", "replay_logit_bound"),
        ("replay near-tie share ((d−1)/T)", "tie_share", "max_near_tie_fraction"),
        ("log-prob |Δ| per token, nats (max)", "lp_max", "logprob_max_abs"),
        ("log-prob |Δ| mean per completion, nats", "lp_mean", "logprob_mean_abs"),
    ]
    print("threshold margins, per run: the threshold (run spec), the worst honest value over every honest rollout and the threshold's")
    print("multiple of it (honest margin), and the nearest cheat: the cheating kind whose median rollout lies closest above the threshold")
    print("(its multiple of the threshold); 'none above' = no cheat kind is caught by this threshold alone at its median; 'beyond' =")
    print("honest rollouts this threshold alone rejects, and the honest values' 99.9 % quantile")
    for name in (str(d)[6:] for d in dtypes):
        t = run_spec(args, DTYPES[name]).toploc
        print(f"{name} workers' run:")
        print(f"  {'threshold':40}{'value':>10}{'worst honest':>14}{'margin':>10}{'99.9 %':>10}{'beyond':>8}  nearest cheat above (median)"
              "   | cheats' medians")
        print(f"  replay rule {t.replay_rule}" + (f", δ = {t.replay_logit_bound} nats (gaps in nats)" if t.replay_rule == "logit-bound-v1"
                                                   else f", ε = {t.replay_eps} (gaps in probability units); logit error: no threshold"))
        for title, attr, fld in table:
            if attr == "gap" and t.replay_rule == "logit-bound-v1":
                fld = "replay_logit_bound"
            value = float(getattr(t, fld))
            if value <= 0:  # the logit error under eps-v1: printed, not thresholded
                values = getattr(honest[name], attr)
                print(f"  {title:40}{'-':>10}{max(values, default=0.0):14.4g}   | cheats' medians: "
                      + ", ".join(f"{k} {statistics.median(getattr(v, attr)):.3g}" for k, v in cheats[name].items() if getattr(v, attr)))
                continue
            values = getattr(honest[name], attr)
            worst = max(values, default=0.0)
            q999 = statistics.quantiles(values, n=1000)[-1] if len(values) > 1 else worst
            # the near-tie share rejects d ≥ 1 differing tokens of T iff (d − 1) / T ≥ the share; the others reject above the value
            beyond = sum(v >= value for v in values if v > 0) if attr == "tie_share" else sum(v > value for v in values)
            per_kind = {k: statistics.median(getattr(v, attr)) for k, v in cheats[name].items() if getattr(v, attr)}
            above = {k: m for k, m in per_kind.items() if m > value}
            nearest = min(above.items(), key=lambda kv: kv[1]) if above else None
            cheat = f"{nearest[0]}: ×{nearest[1] / value:.3g}" if nearest else "none above"
            margin = f"×{value / worst:.3g}" if worst > 0 else "∞"
            print(f"  {title:40}{value:10.4g}{worst:14.4g}{margin:>10}{q999:10.4g}{beyond:8d}  {cheat:30} | "
                  + ", ".join(f"{k} {m:.3g}" for k, m in per_kind.items()))
    print(f"wall time {time.perf_counter() - t_start:.0f} s; load average (1, 5, 15 min) at start {load_start[0]:.1f} {load_start[1]:.1f} "
          f"{load_start[2]:.1f}, at the end " + " ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
