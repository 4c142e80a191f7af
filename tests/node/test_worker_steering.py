"""The steering adversary (node.worker.steering) on the shipped embedded base (0.3 M parameters).

It must pass the replay of whatever spec it is given token by token (it judges each token with the
validator's own check), steer where the spec's tolerance leaves room (bf16 spec: ``logit-bound-v1``,
δ = 1), and be an honest worker when it takes none of its chances.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from node.coordinator.base import EMBEDDED_BASE_DIR
from node.devnet.config import EMBEDDED_RL, EMBEDDED_SAMPLING, precision_toploc
from node.engine.hf import TransformersEngine
from node.worker.adversary import build_dishonest_submission
from node.worker.rollouts import generate_rollouts
from node.worker.steering import SteeringEngine, steer_generate
from protocol import sampling
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.inference import prefill_completions
from protocol.messages import Submission
from protocol.models import load_model, load_tokenizer
from protocol.rollout import plan_submission, unpack_f32, unpack_u32
from protocol.runspec import DataSpec, RunInfo, RunSpec, ToplocSpec

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"s" * 32)
BF16_V1 = ToplocSpec(replay_rule="logit-bound-v1", replay_logit_bound=1.0, max_near_tie_fraction=0.5, logprob_max_abs=2.0,
                     logprob_mean_abs=0.5, worker_dtype="bfloat16")
"""A bf16 run's tolerances under logit-bound-v1 (the steerer must adapt to whichever rule a spec names)."""


def _spec(dtype: str, max_near_tie_fraction: float | None = None, rule: str = "icdf-v1") -> RunSpec:
    """The devnet's embedded run (4 tasks × 16 samples × ≤ 4 tokens at temperature 1.5) with the toploc of ``dtype`` workers
    and sampling rule ``rule``."""
    toploc = precision_toploc(dtype, BF16_V1 if dtype == "bf16" else None)
    if max_near_tie_fraction is not None:
        toploc = toploc.model_copy(update={"max_near_tie_fraction": max_near_tie_fraction})
    return RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=3), data=DataSpec(tasks_per_submission=4),
                   sampling=EMBEDDED_SAMPLING.model_copy(update={"rule": rule}), rl=EMBEDDED_RL, toploc=toploc)


def _replays(spec: RunSpec, policy: torch.nn.Module, plan: list, rollouts: list) -> list[sampling.ReplayResult]:
    """The validator's replay of every rollout (float32 prefill, the spec's rule and tolerances), with its
    termination and log-prob checks asserted on the way."""
    s, t = spec.sampling, spec.toploc
    prompts = [list(p.prompt_ids) for p in plan for _ in p.seeds]
    completions = [unpack_u32(r.completion_ids) for r in rollouts]
    pre = prefill_completions(policy, prompts, completions, 0)
    params = sampling.ReplayParams.from_spec(spec, (1,))
    slack = params.termination_slack()
    out = []
    for r, c, p in zip(rollouts, completions, pre, strict=True):
        assert sampling.termination_check(p.logits[-1], c, [1], s.max_tokens, s.temperature, t.eos_min_prob, slack).ok
        rep = sampling.replay_check(p.logits, c, r.seed, params)
        assert rep.logprobs is not None
        assert sampling.logprob_check(unpack_f32(r.logprobs), rep.logprobs, max_abs=t.logprob_max_abs, mean_abs=t.logprob_mean_abs).ok
        out.append(rep)
    return out


@pytest.fixture(scope="module")
def base() -> tuple[torch.nn.Module, object, list]:
    torch.set_num_threads(1)
    return load_model(EMBEDDED_BASE_DIR), load_tokenizer(EMBEDDED_BASE_DIR), resolve_tasks("embedded").train


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "max_near_tie_fraction", "steers", "rule"),
                         [("bf16", None, True, "icdf-v1"), ("bf16", 0.25, True, "icdf-v1"), ("fp32", None, False, "icdf-v1"),
                          ("bf16", None, True, "gumbel-v2")],
                         ids=["bf16", "bf16-one-near-tie", "fp32", "bf16-gumbel"])
def test_steering_passes_the_replay_of_its_spec_and_steers_where_the_bound_allows(base, dtype: str, max_near_tie_fraction: float | None,
                                                                                  steers: bool, rule: str) -> None:
    """Every emitted token passes the per-token replay of the spec the steerer was given. Under the bf16
    spec (δ = 1 nats) the right answer's token is often admissible: it steers, within the near-tie
    cap (at share 0.25 one per ≤ 4-token completion), and its rollouts answer right more often than
    the same worker's honest ones — under ``gumbel-v2`` too, whose window shrinks a token's chances to
    about ``e^{2δ/T}`` times its own probability, which the right answer's token often has; under the
    float32 spec (ε = 1e-4) a float32 steerer finds next to no room."""
    policy, tok, tasks = base
    spec = _spec(dtype, max_near_tie_fraction, rule)
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    worker = load_model(EMBEDDED_BASE_DIR, dtype=compute)
    plans = [plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter) for counter in range(2)]
    steered = [steer_generate(spec, policy, worker, tok, plan, 1.0, random.Random(1)) for plan in plans]
    honest = [generate_rollouts(spec, TransformersEngine(worker, tok), tok, plan) for plan in plans]
    taken = sum(sum(r.taken) for r in steered)
    for plan, result in zip(plans, steered, strict=True):
        assert sum(result.hard) == 0
        assert all(0 <= t <= c for t, c in zip(result.taken, result.chances, strict=True))
        for rep, near, n in zip(_replays(spec, policy, plan, result.rollouts), result.near_ties, result.tokens, strict=True):
            assert rep.ok, rep.reason
            assert rep.near_ties == near and near <= math.ceil(spec.toploc.max_near_tie_fraction * n)
    reward = sum(r.task_reward for res in steered for r in res.rollouts)
    honest_reward = sum(r.task_reward for rs in honest for r in rs)
    if steers:
        assert taken >= 10 and reward > honest_reward
    else:
        assert taken <= 2


def test_steering_at_rate_zero_is_the_honest_worker(base) -> None:
    """Taking none of its chances, the steerer emits exactly what the honest bf16 engine samples (the
    same tokens and log-probs: its lock-step decode is the engine's, only the choice differs); it still
    counts the chances it had."""
    policy, tok, tasks = base
    spec = _spec("bf16")
    worker = load_model(EMBEDDED_BASE_DIR, dtype=torch.bfloat16)
    plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, 0)
    result = steer_generate(spec, policy, worker, tok, plan, 0.0, random.Random(1))
    honest = generate_rollouts(spec, TransformersEngine(worker, tok), tok, plan)
    assert sum(result.taken) == 0 and sum(result.chances) > 0
    for a, b in zip(result.rollouts, honest, strict=True):
        assert a.completion_ids == b.completion_ids and a.task_reward == b.task_reward
        assert max(abs(x - y) for x, y in zip(unpack_f32(a.logprobs), unpack_f32(b.logprobs), strict=True)) < 0.02  # prefill vs decode, bf16


def test_steer_adversary_submission_and_engine(base) -> None:
    """``build_dishonest_submission("steer", …)`` through a :class:`SteeringEngine` (bf16 worker, float32
    policy) signs a valid submission and counts its steering; the rate is bounded."""
    policy, tok, tasks = base
    spec = _spec("bf16")
    engine = SteeringEngine(TransformersEngine(load_model(EMBEDDED_BASE_DIR), tok, compute_dtype=torch.bfloat16), policy, 1.0, random.Random(2))
    blob = build_dishonest_submission("steer", spec, spec.run_id, WORKER, engine, tok, tasks, 0, 0)
    env = open_envelope(blob, run_id=spec.run_id, expect=Submission)
    assert len(env.body.rollouts) == 64
    assert engine.totals.rollouts == 64 and engine.totals.taken == engine.totals.chances > 0
    with pytest.raises(ValueError, match="float32 policy"):
        SteeringEngine(TransformersEngine(load_model(EMBEDDED_BASE_DIR), tok, compute_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rate"):
        SteeringEngine(TransformersEngine(load_model(EMBEDDED_BASE_DIR), tok), rate=1.5)


@pytest.mark.slow
def test_under_logit_bound_v2_the_steerer_is_accepted_per_submission_and_flagged_by_the_audit(base) -> None:
    """The attack issue 33 describes, end to end with the real worker, pipeline and audit: under a
    ``logit-bound-v2`` spec a full-rate steerer's submissions pass every per-submission check (no
    single submission can tell it from bf16 noise), but the audit, calibrated the coordinator's way
    on honest bf16 reference submissions, flags it within its first 1,000 tokens, while an honest
    bf16 worker's statistics over as many tokens stay far from the threshold."""
    from node.coordinator.calibrate import worker_engine
    from node.worker.rollouts import build_submission, seal_submission
    from protocol.audit import AuditState, Baseline, HeldSubmission, verdict_mismatch
    from protocol.models import head_weight
    from trainer.ledger.store import completion_tokens
    from validator.pipeline import SubmissionChecker

    policy, tok, tasks = base
    toploc = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.2, worker_dtype="bfloat16", fp32_logits=True,
                        logprob_max_abs=2.8, logprob_mean_abs=0.95, max_mant_err_mean=17.0, max_mant_err_median=10.0,
                        max_near_tie_fraction=0.14)  # what spec init --measure-precision bfloat16 --fp32-logits measured on this base
    spec = RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=3), data=DataSpec(tasks_per_submission=4), sampling=EMBEDDED_SAMPLING,
                   rl=EMBEDDED_RL, toploc=toploc)
    checker = SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda *_: False)
    reference, baseline = worker_engine(spec, EMBEDDED_BASE_DIR), Baseline(1e-6, 1)
    cal = NodeKey.from_seed(b"k" * 32)
    counter = 0
    while baseline.tokens() < 3000:
        result = checker.check(open_envelope(build_submission(spec, spec.run_id, cal, reference, tok, tasks, 0, counter),
                                             run_id=spec.run_id, expect=Submission))
        counter += 1
        assert result.stats is not None
        baseline.add(0, result.stats)
    bounds = baseline.bounds()
    worker = load_model(EMBEDDED_BASE_DIR, dtype=torch.bfloat16)
    head = head_weight(EMBEDDED_BASE_DIR)
    steerer, tokens, flag, rng = AuditState(), 0, None, random.Random(4)
    for counter in range(6):
        plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter)
        steered = steer_generate(spec, policy, worker, tok, plan, 1.0, rng, head_fp32=head)
        result = checker.check(open_envelope(seal_submission(spec.run_id, WORKER, 0, counter, plan, steered.rollouts),
                                             run_id=spec.run_id, expect=Submission))
        assert result.accepted, (result.reason, result.evidence)  # per submission it passes
        assert result.stats is not None and sum(steered.taken) > 0
        steerer.observe(result.stats, bounds)
        tokens += result.stats.tokens
        flag = steerer.flag(1e-6, bounds)
        if flag is not None:
            break
    assert flag is not None and tokens <= 1000, (tokens, steerer.log_e_value())
    honest_key, honest, honest_tokens = NodeKey.from_seed(b"h" * 32), AuditState(), 0
    engine = worker_engine(spec, EMBEDDED_BASE_DIR, max_batch=8)  # another batch size than the calibration's
    for counter in range(6):
        env = open_envelope(build_submission(spec, spec.run_id, honest_key, engine, tok, tasks, 0, counter), run_id=spec.run_id, expect=Submission)
        result = checker.check(env)
        assert result.stats is not None
        held = HeldSubmission(len(env.body.rollouts), completion_tokens(env.body))
        assert verdict_mismatch(result.stats, held, rule=spec.audit.rule, chunk_size=spec.toploc.chunk_size) is None  # what the coordinator counts
        honest.observe(result.stats, bounds)
        honest_tokens += result.stats.tokens
    assert honest_tokens >= tokens and honest.flag(1e-6, bounds) is None and honest.log_e_value() < math.log(1e6) / 2
