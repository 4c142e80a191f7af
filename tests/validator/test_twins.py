"""The validator's float32 twins (validator/twins.py, the pipeline under ``audit.rule = "eprocess-v2"``) on the
shipped embedded base: the twin is the run's own seeded decode from the first differing token, a rollout
steered to pass where it diverged is counted ``up``, honest work is counted as the red team's float32-twin
comparison counts it, at most ``TWINS_PER_SUBMISSION`` twins are decoded per submission, and other audit
rules sign no twin counts."""

from __future__ import annotations

import random

import pytest
import torch

from node.coordinator.base import EMBEDDED_BASE_DIR
from node.coordinator.calibrate import worker_engine
from node.devnet.config import EMBEDDED_RL, EMBEDDED_SAMPLING
from node.engine.hf import TransformersEngine
from node.worker.rollouts import generate_rollouts, seal_submission
from node.worker.steering import steer_generate
from protocol import sampling
from protocol.audit import TWINS_PER_SUBMISSION
from protocol.dataset import resolve_tasks
from protocol.envelope import open_envelope
from protocol.identity import NodeKey
from protocol.messages import Submission
from protocol.models import load_model, load_tokenizer
from protocol.rollout import plan_submission, unpack_u32
from protocol.runspec import AuditSpec, DataSpec, RunInfo, RunSpec, ToplocSpec
from validator.pipeline import SubmissionChecker
from validator.twins import decode_twins

COORD = NodeKey.from_seed(b"c" * 32)
WORKER = NodeKey.from_seed(b"t" * 32)
TOPLOC = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.2, worker_dtype="bfloat16", fp32_logits=True, logprob_max_abs=2.8,
                    logprob_mean_abs=0.95, max_mant_err_mean=17.0, max_mant_err_median=10.0, max_near_tie_fraction=0.14)
"""What spec init --measure-precision bfloat16 --fp32-logits measured on this base (tests/node/test_worker_steering.py)."""


def _spec(rule: str = "eprocess-v2") -> RunSpec:
    return RunSpec(run=RunInfo(coordinator=COORD.peer_id, seed=3), data=DataSpec(tasks_per_submission=4), sampling=EMBEDDED_SAMPLING,
                   rl=EMBEDDED_RL, toploc=TOPLOC, audit=AuditSpec(rule=rule))


@pytest.fixture(scope="module")
def base() -> tuple[torch.nn.Module, object, list]:
    torch.set_num_threads(1)
    return load_model(EMBEDDED_BASE_DIR), load_tokenizer(EMBEDDED_BASE_DIR), resolve_tasks("embedded").train


def _checker(spec: RunSpec, policy: torch.nn.Module, tok: object, tasks: list) -> SubmissionChecker:
    return SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda *_: False,
                             twin_rng=random.Random(0))


def _check(checker: SubmissionChecker, spec: RunSpec, counter: int, plan: list, rollouts: list):
    """Check a submission; its replay statistics are those the coordinator's audit will count: their
    tokens, chunks and rollouts agree with the submission it holds (``protocol.audit.verdict_mismatch``)."""
    from protocol.audit import HeldSubmission, verdict_mismatch
    from trainer.ledger.store import completion_tokens

    env = open_envelope(seal_submission(spec.run_id, WORKER, 0, counter, plan, rollouts), run_id=spec.run_id, expect=Submission)
    result = checker.check(env)
    if result.stats is not None:
        held = HeldSubmission(len(env.body.rollouts), completion_tokens(env.body))
        assert verdict_mismatch(result.stats, held, rule=spec.audit.rule, chunk_size=spec.toploc.chunk_size) is None
    return result


def _steered_to_pass(spec: RunSpec, policy: torch.nn.Module, tok: object, tasks: list) -> tuple[int, list, list, object, list[int]]:
    """The first of 6 submissions (counter, plan, honest float32 rollouts, full-rate steered ones) where the steerer
    made some rollout pass that failed honestly, and those rollouts' indices."""
    rng = random.Random(4)
    for counter in range(6):
        plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter)
        honest = generate_rollouts(spec, TransformersEngine(policy, tok), tok, plan)
        steered = steer_generate(spec, policy, policy, tok, plan, 1.0, rng)
        pick = [j for j, (h, s) in enumerate(zip(honest, steered.rollouts)) if steered.taken[j] and s.task_reward > h.task_reward]
        if pick:
            return counter, plan, honest, steered, pick
    raise AssertionError("no rollout steered from fail to pass in 6 submissions")


def test_the_twin_of_a_float32_completion_is_the_completion_itself(base) -> None:
    """Decoding from any prefix of a float32 worker's own completion (its token at that position being the
    replay's choice) reproduces the rest of it: the twin uses the run's sampler with the rollout's seed and
    completion positions. A prefix ending with EOS or at max_tokens is returned as is; bad input raises."""
    policy, tok, tasks = base
    spec = _spec()
    plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, 0)
    rollouts = generate_rollouts(spec, TransformersEngine(policy, tok), tok, plan)
    params = sampling.ReplayParams.from_spec(spec, (int(tok.eos_token_id),))
    prompts, prefixes, seeds, want = [], [], [], []
    for ro in rollouts[:24]:
        completion = unpack_u32(ro.completion_ids)
        cut = 1 + ro.sample % len(completion)  # keep 1 … n tokens
        prompts.append(unpack_u32(ro.prompt_ids))
        prefixes.append(completion[:cut])
        seeds.append(ro.seed)
        want.append(completion)
    got = decode_twins(policy, prompts, prefixes, seeds, params, spec.sampling.max_tokens, 0)
    assert got == want
    assert all(len(t) <= spec.sampling.max_tokens and int(tok.eos_token_id) not in t[:-1] for t in got)
    eos = int(tok.eos_token_id)
    assert decode_twins(policy, [[5, 6]], [[7, eos]], [1], params, 4, 0) == [[7, eos]]
    assert decode_twins(policy, [[5, 6]], [[7, 8, 9, 10]], [1], params, 4, 0) == [[7, 8, 9, 10]]
    with pytest.raises(ValueError):
        decode_twins(policy, [[5, 6]], [[7, 8, 9, 10, 11]], [1], params, 4, 0)


def test_a_rollout_steered_to_pass_where_it_diverges_is_counted_up(base) -> None:
    """A float32 worker's submission in which one rollout is replaced by one the steerer made pass by
    emitting the answer's token where the replay chose otherwise: one rollout diverged, its twin (the honest
    float32 decode) fails, so it is decided ``up``. The honest submission itself has no diverged rollout."""
    policy, tok, tasks = base
    spec = _spec()
    checker = _checker(spec, policy, tok, tasks)
    counter, plan, honest, steered, pick = _steered_to_pass(spec, policy, tok, tasks)
    clean = _check(checker, spec, counter, plan, honest)
    assert clean.accepted and clean.stats is not None
    assert (clean.stats.rollouts, clean.stats.diverged, clean.stats.decided, clean.stats.up, clean.stats.down) == (64, 0, 0, 0, 0)
    mixed = list(honest)
    mixed[pick[0]] = steered.rollouts[pick[0]]
    result = _check(checker, spec, counter, plan, mixed)
    assert result.accepted, (result.reason, result.evidence)
    s = result.stats
    assert s is not None and (s.rollouts, s.diverged, s.decided, s.up, s.down) == (64, 1, 1, 1, 0), s
    assert "twins" in result.timings


def test_steered_and_honest_submissions_are_counted_consistently(base) -> None:
    """A full-rate float32 steerer: every diverged rollout is a steered one, at most
    ``TWINS_PER_SUBMISSION`` of them decided, ups and no downs. An honest bf16 worker (float32 logits):
    its diverged rollouts are decided as comparing its task reward with the float32 worker's of the same
    seeds counts them (the red team's twin comparison). Under ``eprocess-v1`` no twin count is signed."""
    policy, tok, tasks = base
    spec = _spec()
    checker = _checker(spec, policy, tok, tasks)
    rng = random.Random(5)
    ups = 0
    for counter in range(2):
        plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter)
        steered = steer_generate(spec, policy, policy, tok, plan, 1.0, rng)
        s = _check(checker, spec, counter, plan, steered.rollouts).stats
        assert s is not None and s.diverged == sum(1 for t in steered.taken if t) > TWINS_PER_SUBMISSION
        assert s.decided == TWINS_PER_SUBMISSION and s.down == 0
        ups += s.up
    assert ups >= 6
    bf16, fp32 = worker_engine(spec, EMBEDDED_BASE_DIR), TransformersEngine(policy, tok)
    seen = 0
    for counter in range(2, 8):
        plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter)
        claimed, twin = generate_rollouts(spec, bf16, tok, plan), generate_rollouts(spec, fp32, tok, plan)
        s = _check(checker, spec, counter, plan, claimed).stats
        diverged = [(c, t) for c, t in zip(claimed, twin) if c.completion_ids != t.completion_ids]
        assert s is not None and s.rollouts == 64 and s.diverged == len(diverged) == s.decided  # ≤ 8 diverged here: all decided
        assert (s.up, s.down) == (sum(c.task_reward > t.task_reward for c, t in diverged), sum(t.task_reward > c.task_reward for c, t in diverged))
        seen += s.diverged
    assert seen > 0
    v1 = _spec("eprocess-v1")
    plan = plan_submission(v1, tasks, tok, WORKER.peer_id, 0, 0)
    s = _check(_checker(v1, policy, tok, tasks), v1, 0, plan, steer_generate(v1, policy, policy, tok, plan, 1.0, random.Random(5)).rollouts).stats
    assert s is not None and s.differ > 0 and (s.rollouts, s.diverged, s.decided, s.up, s.down) == (0, 0, 0, 0, 0)


def test_twin_share_decodes_twins_for_that_share_of_full_checks(base) -> None:
    """``audit.twin_share`` < 1: a full check decodes its twins only when the validator's own draw says so
    (the rest count their rollouts and diverged ones, nothing decided); the calibration's override decodes
    every one."""
    policy, tok, tasks = base
    spec = _spec().model_copy(update={"audit": AuditSpec(rule="eprocess-v2", twin_share=0.5)})
    checker = _checker(spec, policy, tok, tasks)
    every = SubmissionChecker(spec, tasks, tok, lambda s: policy, trainer_step=lambda: 0, counter_seen=lambda *_: False,
                              twin_rng=random.Random(0), twin_share=1.0)
    rng, decided = random.Random(6), []
    for counter in range(8):
        plan = plan_submission(spec, tasks, tok, WORKER.peer_id, 0, counter)
        rollouts = steer_generate(spec, policy, policy, tok, plan, 1.0, rng).rollouts
        s = _check(checker, spec, counter, plan, rollouts).stats
        assert s is not None and s.diverged > 0 and s.decided in (0, min(TWINS_PER_SUBMISSION, s.diverged))
        decided.append(s.decided > 0)
        full = _check(every, spec, counter, plan, rollouts).stats
        assert full is not None and full.decided == min(TWINS_PER_SUBMISSION, full.diverged)
    assert any(decided) and not all(decided), decided


@pytest.mark.parametrize(("limit", "decided"), [("memory", 1), ("output", 1), ("wall", 0), ("cpu", 0)])
def test_a_twin_stopped_at_a_memory_or_output_limit_fails_and_one_at_a_time_limit_is_undecided(base, monkeypatch, limit, decided) -> None:
    """The twin's reward stopped at a limit: memory and output are the program's own (the same program hits them on
    any machine), so the twin fails and the steered rollout is decided ``up`` — skipping them let a steerer shelter
    its ups behind honest programs that blow up (red team a33b); a wall or CPU limit may be the validator's own load,
    so that twin is left undecided, never evidence."""
    import dataclasses

    from validator import pipeline

    policy, tok, tasks = base
    spec = _spec()
    checker = _checker(spec, policy, tok, tasks)
    counter, plan, honest, steered, pick = _steered_to_pass(spec, policy, tok, tasks)
    mixed = list(honest)
    mixed[pick[0]] = steered.rollouts[pick[0]]
    real_twins, real_reward = SubmissionChecker._twins, pipeline.compute_reward

    def twins_at_a_limit(self, *args, **kwargs):  # only the twins' rewards stop at the limit
        with monkeypatch.context() as m:
            m.setattr(pipeline, "compute_reward", lambda *a, **k: dataclasses.replace(real_reward(*a, **k), task_reward=0.0, limit_hit=limit))
            return real_twins(self, *args, **kwargs)

    monkeypatch.setattr(SubmissionChecker, "_twins", twins_at_a_limit)
    result = _check(checker, spec, counter, plan, mixed)
    s = result.stats
    assert result.accepted and s is not None, (result.reason, result.evidence)
    assert (s.diverged, s.decided, s.up, s.down) == (1, decided, decided, 0), s
