"""Measuring a run's numeric tolerances on its own model: honest submissions in the workers' dtype.

A bf16 run's replay bound δ, log-prob bounds and TOPLOC thresholds are statements about the
arithmetic of honest workers (``docs/toploc.md`` §6.2, §10): they are measured, not assumed. This
module generates honest submissions with the worker's own code (:func:`node.worker.rollouts.
build_submission`) in the given compute dtype, over several decode batch sizes (batching changes
padding and reduction order), checks each with the validators' pipeline under a permissive spec
that rejects nothing for tolerance, and reads the largest value of every toleranced quantity
(:attr:`validator.pipeline.CheckResult.extremes`). :meth:`PrecisionMeasurement.toploc` turns them
into a ``logit-bound-v3`` ``[toploc]`` section with the margins :data:`MARGINS` states.
``intellect-node spec init --measure-precision bfloat16`` and ``devnet --worker-dtype bf16`` call it
on the base; an operator re-measures on the kind of machine the workers run (``docs/operators.md``).

It starts no process and reads only the model directory it is given.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node.engine.hf import TransformersEngine
from node.worker.rollouts import build_submission
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.models import load_model
from protocol.runspec import LOGIT_BOUND_LIMIT, LOGPROB_TOL_LIMIT, REPLAY_RULE_LOGIT_BOUND_V3, RunSpec, ToplocSpec
from protocol.tasks import Task
from validator.pipeline import EXTREMES, SubmissionChecker

logger = logging.getLogger(__name__)

MARGINS = {"gap": 3.0, "logprob": 2.0, "toploc": 2.0, "near_ties": 3.0}
"""Bound ÷ worst honest value measured, per quantity: δ three times the largest replay gap of an honest
token (it grows with the number of positions seen: docs/toploc.md §10), the log-prob bounds and TOPLOC
thresholds twice theirs, the per-submission near-tie share three times the largest honest one. Beyond
a bound a value is a benign ``precision`` finding up to ``toploc.hard_factor`` (2) times it."""
FLOORS = {"gap": 0.1, "logprob_abs": 0.01, "logprob_mean_abs": 0.001, "near_ties": 0.1}
"""Smallest bounds stated whatever the measurement: a δ under 0.1 nats is below a bf16 logit's own rounding
at logits of 20–40; the log-prob floors are the float32 defaults; near ties: the float32 default share."""
BF16_DELTA_FLOOR = 1.0
"""Smallest δ of a ``bfloat16`` measurement, nats: the documented bf16 default (``docs/toploc.md`` §6.2, §10).
A measurement of a few dozen submissions sees the honest tail only by chance: on the embedded base one
recurring context errs by 1.5–1.72 nats in bf16 (with float32 logits), in ≈ 2 % of honest submissions
(13 of 651 beyond 0.98 nats), and ten draws of the devnet's measurement (24 submissions) gave a worst gap of
0.156–1.661 nats, so δ = 0.47–4.0 (red team h41b, 7 Dec 2026). Under ``logit-bound-v2`` a token beyond δ
with a finite gap is a benign ``precision`` rejection (never a ban by itself; only a token no logits within
any bound pick is a ``sampling`` cheat): at δ = 0.47 that context would cost honest workers ≈ 2 % of their
submissions and raise the audit's calibrated out-of-bound rate, which a steerer then hides under. At this
floor the honest tail measured so far (1.72 nats on the embedded base, up to 1.99 reported in issue #33)
lies within 2δ."""
BATCHES = (1, 8, 64)
"""Decode batch sizes measured (sequences per forward pass)."""


@dataclass
class PrecisionMeasurement:
    """The largest honest values of every toleranced quantity, over all measured submissions.

    Attributes:
        dtype: the workers' compute dtype measured (``float32`` or ``bfloat16``).
        fp32_logits: whether the workers took their logits from the float32 LM head.
        submissions, rollouts, tokens: how much was measured.
        extremes: quantity (:data:`validator.pipeline.EXTREMES`) → the largest honest value.
        near_tie_share: the largest share of a submission's tokens that differed from the replay.
        differ_rate: tokens that differed from the replay over all tokens.
        seconds: wall time of the measurement, seconds.
    """

    dtype: str
    fp32_logits: bool = False
    submissions: int = 0
    rollouts: int = 0
    tokens: int = 0
    extremes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(EXTREMES, 0.0))
    near_tie_share: float = 0.0
    differ_rate: float = 0.0
    seconds: float = 0.0

    def delta_floor(self) -> float:
        """The smallest δ this measurement may state, nats: :data:`BF16_DELTA_FLOOR` for ``bfloat16`` workers,
        ``FLOORS["gap"]`` otherwise."""
        return BF16_DELTA_FLOOR if self.dtype == "bfloat16" else FLOORS["gap"]

    def toploc(self, base: ToplocSpec, temperature: float) -> ToplocSpec:
        """``base`` with replay rule ``logit-bound-v3`` and every tolerance set from this measurement
        (:data:`MARGINS`, :data:`FLOORS`, :data:`BF16_DELTA_FLOOR`; capped at what the spec accepts). δ also covers the largest
        EOS shortfall seen: the logit error that takes P(EOS) from the floor ``f`` down to ``f − s`` is
        ``T / 2 · (logit f − logit(f − s))`` (``docs/toploc.md`` §6.2, §7)."""
        x = self.extremes
        f, short = base.eos_min_prob, x["eos_shortfall"]
        eos_gap = temperature / 2 * (_logit(f) - _logit(f - short)) if 0 < short < f < 1 else 0.0
        self.extremes["eos_gap"] = eos_gap
        delta = min(LOGIT_BOUND_LIMIT, max(self.delta_floor(), MARGINS["gap"] * max(x["gap"], eos_gap)))
        lp_max = min(LOGPROB_TOL_LIMIT, max(FLOORS["logprob_abs"], MARGINS["logprob"] * x["logprob_abs"]))
        lp_mean = min(lp_max, max(FLOORS["logprob_mean_abs"], MARGINS["logprob"] * x["logprob_mean_abs"]))
        update: dict[str, Any] = {
            "replay_rule": REPLAY_RULE_LOGIT_BOUND_V3, "replay_logit_bound": round(delta, 4), "worker_dtype": self.dtype,
            "fp32_logits": self.fp32_logits and self.dtype == "bfloat16",
            "logprob_max_abs": round(lp_max, 4), "logprob_mean_abs": round(lp_mean, 4),
            "max_near_tie_fraction": round(min(1.0, max(FLOORS["near_ties"], MARGINS["near_ties"] * self.near_tie_share)), 4),
            "max_mismatches": min(base.topk, max(base.max_mismatches, math.ceil(MARGINS["toploc"] * x["toploc_mismatches"]))),
            "max_mant_err_mean": round(max(base.max_mant_err_mean, MARGINS["toploc"] * x["toploc_mant_err_mean"]), 3),
            "max_mant_err_median": round(max(base.max_mant_err_median, MARGINS["toploc"] * x["toploc_mant_err_median"]), 3),
            "replay_eps": ToplocSpec().replay_eps, "eos_prob_slack": ToplocSpec().eos_prob_slack,
        }
        return ToplocSpec.model_validate({**base.model_dump(), **update})

    def lines(self, chosen: ToplocSpec) -> list[str]:
        """A table for the operator: each quantity's worst honest value, the bound chosen and its margin."""
        x = self.extremes
        rows = [("replay gap of a differing token, nats (δ)", x["gap"], chosen.replay_logit_bound),
                ("logit error explaining a stop's P(EOS), nats (δ)", x.get("eos_gap", 0.0), chosen.replay_logit_bound),
                ("log-prob |Δ| per token, nats", x["logprob_abs"], chosen.logprob_max_abs),
                ("log-prob |Δ| mean per completion, nats", x["logprob_mean_abs"], chosen.logprob_mean_abs),
                ("near-tie share of a submission", self.near_tie_share, chosen.max_near_tie_fraction),
                ("TOPLOC mismatches per chunk", x["toploc_mismatches"], float(chosen.max_mismatches)),
                ("TOPLOC mantissa error mean", x["toploc_mant_err_mean"], chosen.max_mant_err_mean),
                ("TOPLOC mantissa error median", x["toploc_mant_err_median"], chosen.max_mant_err_median)]
        logits = " with float32 logits" if self.fp32_logits else ""
        out = [(f"measured {self.submissions} honest {self.dtype}{logits} submissions ({self.rollouts} rollouts, {self.tokens} tokens; "
               f"{self.differ_rate:.2%} of tokens differ from the float32 replay) in {self.seconds:.0f} s:")]
        for name, worst, bound in rows:
            margin = f"x{bound / worst:.2f}" if worst > 0 else "inf"
            out.append(f"  {name:<44} worst {worst:<10.4g} bound {bound:<10.4g} margin {margin}")
        if self.dtype == "bfloat16" and chosen.replay_logit_bound <= BF16_DELTA_FLOOR:
            out.append(f"  δ is the bf16 floor {BF16_DELTA_FLOOR:g} nats: honest bf16 errors beyond what a few dozen submissions "
                       "show occur (docs/toploc.md §10)")
        return out


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def measure_precision(spec: RunSpec, model_dir: Path, tasks: Sequence[Task], tokenizer: Any, dtype: str, *, submissions: int = 20,
                      batches: Sequence[int] = BATCHES, device: str = "cpu", fp32_head: bool = False) -> PrecisionMeasurement:
    """Generate ``submissions`` honest submissions per batch size in ``dtype`` and measure every toleranced quantity.

    Args:
        spec: the run spec (tasks, sampling, group size; its ``[toploc]`` is replaced by a permissive one).
        model_dir: the policy (the base) as published.
        tasks: the run's training tasks; tokenizer: the policy's.
        dtype: the workers' compute dtype (``float32`` or ``bfloat16``).
        submissions: per batch size.
        batches: decode batch sizes.
        device: torch device.
        fp32_head: the workers compute their logits with a float32 LM head (``join --fp32-logits``).

    Returns:
        The :class:`PrecisionMeasurement`.
    """
    t0 = time.perf_counter()
    permissive = spec.model_copy(update={"toploc": ToplocSpec(
        replay_rule=REPLAY_RULE_LOGIT_BOUND_V3, replay_logit_bound=LOGIT_BOUND_LIMIT, logprob_max_abs=LOGPROB_TOL_LIMIT,
        logprob_mean_abs=LOGPROB_TOL_LIMIT, hard_factor=16.0, max_mismatches=spec.toploc.topk, max_mant_err_mean=1e4,
        max_mant_err_median=1e4, max_near_tie_fraction=1.0, chunk_size=spec.toploc.chunk_size, topk=spec.toploc.topk,
        eos_min_prob=spec.toploc.eos_min_prob)})
    run_id = permissive.run_id
    policy = load_model(Path(model_dir), device=device)
    checker = SubmissionChecker(permissive, tasks, tokenizer, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda *_: False)
    key = NodeKey.generate()
    out = PrecisionMeasurement(dtype, fp32_logits=fp32_head)
    differ = 0
    counter = 0
    for batch in batches:
        engine = TransformersEngine.from_dir(Path(model_dir), device=device, max_batch=batch, compute_dtype=getattr(torch, dtype),
                                             fp32_head=fp32_head)
        for _ in range(submissions):
            raw = build_submission(permissive, run_id, key, engine, tokenizer, tasks, 0, counter)
            counter += 1
            env = open_envelope(raw, run_id=run_id, expect=Submission)
            result = checker.check(env)
            if result.stats is None:  # rejected before the model checks: the measurement itself is wrong
                raise RuntimeError(f"an honest {dtype} submission was rejected before its model checks: {result.reason} {result.evidence}")
            out.submissions += 1
            out.rollouts += len(env.body.rollouts)
            out.tokens += result.stats.tokens
            differ += result.stats.differ
            out.near_tie_share = max(out.near_tie_share, result.stats.differ / max(1, result.stats.tokens))
            for k, v in result.extremes.items():
                out.extremes[k] = max(out.extremes[k], v)
    out.differ_rate = differ / max(1, out.tokens)
    out.seconds = time.perf_counter() - t0
    return out


MEASUREMENT_VERSION = 1
"""Bumped when what :func:`measure_precision` measures changes: cached measurements of an older version are not reused."""


def cached_measurement(spec: RunSpec, model_dir: Path, tasks: Sequence[Task], tokenizer: Any, dtype: str, *, fp32_logits: bool,
                       cache_dir: Path, submissions: int = 20, batches: Sequence[int] = BATCHES) -> tuple[PrecisionMeasurement, bool]:
    """:func:`measure_precision` once per machine: the result is kept under ``cache_dir`` keyed by the
    model's bytes (:func:`protocol.models.base_hash`), the tasks, sampling and TOPLOC parameters, the
    dtype, the logits' precision, the number of submissions, torch's version and
    :data:`MEASUREMENT_VERSION` (the arithmetic measured is this machine's: the cache is not shared).

    Returns:
        The measurement and whether it came from the cache.
    """
    import hashlib
    import json

    from protocol.durable import atomic_write
    from protocol.models import base_hash

    key_doc = {"v": MEASUREMENT_VERSION, "model": base_hash(Path(model_dir)), "tasks": spec.data.model_dump(mode="json"),
               "sampling": spec.sampling.model_dump(mode="json"), "toploc": [spec.toploc.chunk_size, spec.toploc.topk, spec.toploc.eos_min_prob],
               "group": spec.rl.group_size, "dtype": dtype, "fp32_logits": fp32_logits, "n": submissions, "batches": list(batches),
               "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(cache_dir) / f"precision-{key}.json"
    try:
        doc = json.loads(path.read_text())
        return PrecisionMeasurement(**doc), True
    except (OSError, ValueError, TypeError):
        pass  # not measured on this machine yet (or a damaged file: measured again)
    m = measure_precision(spec, model_dir, tasks, tokenizer, dtype, submissions=submissions, batches=batches, fp32_head=fp32_logits)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(m.__dict__, sort_keys=True).encode(), durable=False)
    return m, False
