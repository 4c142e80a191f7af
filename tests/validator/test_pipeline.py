"""SubmissionChecker against real workers: every cheat rejected with its reason, honest work accepted.

Every dishonest submission comes from a real worker variant (``node.worker.adversary``) or from
the honest worker code run with a different model; the malformed ones are honest submissions
edited field by field and re-signed with the worker's key, so the envelope itself is valid and
only the validator's checks can refuse them. The policy is the embedded base model (a tiny
Qwen2 warm-started on the task answers, shipped in the package: the same bytes on every machine).
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from node.coordinator.base import prepare_base
from node.engine.hf import TransformersEngine
from node.worker.adversary import build_dishonest_submission, perturbed_model
from node.worker.rollouts import build_submission
from protocol.dataset import resolve_tasks
from protocol.envelope import Envelope, open_envelope, seal
from protocol.identity import NodeKey
from protocol.messages import Submission, Verdict
from protocol.models import build_model, load_model, load_tokenizer
from protocol.rollout import pack_f32, pack_u32, unpack_f32, unpack_u32
from protocol.runspec import DataSpec, RLSpec, RunInfo, RunSpec, SamplingSpec, ToplocSpec
from protocol.tasks import Task
from protocol.verdicts import ALL_REASONS, is_cheat
from validator.judgements import Judgements
from validator.pipeline import CheckResult, SubmissionChecker

COORD = NodeKey.from_seed(b"c" * 32)
VALIDATOR = NodeKey.from_seed(b"v" * 32)
WORKER = NodeKey.from_seed(b"w" * 32)
SPEC = RunSpec(
    run=RunInfo(coordinator=COORD.peer_id, validators=[VALIDATOR.peer_id], seed=7),
    data=DataSpec(tasks_per_submission=4),
    # temperature 2: the embedded answers are 1-3 characters, a hot sampler makes longer completions
    sampling=SamplingSpec(max_tokens=8, temperature=2.0),
    rl=RLSpec(group_size=4, async_level=2),
)
RUN = SPEC.run_id
SHORT_SPEC = SPEC.model_copy(update={"sampling": SPEC.sampling.model_copy(update={"max_tokens": 2})})
"""``SPEC`` capped at 2 tokens: most embedded answers take 3 tokens (two digits and EOS), so most
completions end by length (246 of 256 with the shipped base); under ``SPEC`` 254 of 256 end by EOS.
The honest-work test checks both, so each ending is covered by construction, not by a rare draw."""
ROLLOUTS = SPEC.data.tasks_per_submission * SPEC.rl.group_size  # 16 per submission


@dataclass
class World:
    """The run's policy at step 0 and what a worker needs to generate with it."""

    tasks: list[Task]
    tokenizer: Any
    model: torch.nn.Module
    engine: TransformersEngine

    def checker(
        self,
        *,
        spec: RunSpec = SPEC,
        trainer_step: int = 0,
        steps: tuple[int, ...] = (0,),
        counter_seen: Callable[[str, int, str], bool] | None = None,
    ) -> SubmissionChecker:
        """A checker whose validator holds the policy for ``steps`` (the same weights) and no other."""
        return SubmissionChecker(
            spec, self.tasks, self.tokenizer, lambda s: self.model if s in steps else None,
            trainer_step=lambda: trainer_step, counter_seen=counter_seen or (lambda w, c, sid: False),
        )


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    cache = getattr(request.config, "cache", None)
    cache_dir = Path(cache.mkdir("intellect-embedded-base")) if cache is not None else tmp_path_factory.mktemp("base")
    tasks = resolve_tasks("embedded")
    base = prepare_base(SPEC, tasks, cache_dir)  # the shipped embedded base
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tok = load_tokenizer(base)
    model = load_model(base)
    yield World(tasks.train, tok, model, TransformersEngine(model, tok))
    torch.set_num_threads(threads)


def opened(blob: bytes, run_id: str = RUN) -> Envelope[Submission]:
    return open_envelope(blob, run_id=run_id, expect=Submission)


def honest(world: World, counter: int, step: int = 0, engine: TransformersEngine | None = None,
           spec: RunSpec = SPEC) -> Envelope[Submission]:
    return opened(build_submission(spec, spec.run_id, WORKER, engine or world.engine, world.tokenizer, world.tasks, step, counter),
                  spec.run_id)


def assert_rejected(result: CheckResult, reasons: set[str]) -> None:
    """Rejected for one of ``reasons``, and the verdict it makes is a valid signed message."""
    assert not result.accepted, f"accepted, expected one of {reasons}"
    assert result.reason in reasons, f"rejected for {result.reason} {result.evidence}, expected one of {reasons}"
    assert result.reason in ALL_REASONS
    seal(VALIDATOR, RUN, Verdict(submission_id=b"\x00" * 32, worker=WORKER.peer_id, policy_step=0, counter=0,
                                 accepted=False, reason=result.reason, evidence=result.evidence))


# --- honest work -------------------------------------------------------------------------------


@pytest.mark.slow
def test_honest_workers_accepted_across_batch_sizes_and_threads(world: World) -> None:
    """0 false rejections over 320 rollouts from engines batching 1, 8 or 64 sequences on 1 or 2 threads.

    Batch size changes padding and matmul shapes, thread count changes reduction order: the
    worker's logits and rows differ from the validator's batched prefill in the last bits, which
    the TOPLOC thresholds, the replay's near-tie margin and the log-prob tolerance must absorb.
    Each engine setting makes four submissions under ``SPEC`` (nearly all end by EOS) and one under
    ``SHORT_SPEC`` (nearly all end by length), so both endings are checked whatever the machine.
    """
    checkers = {SPEC.run_id: world.checker(), SHORT_SPEC.run_id: world.checker(spec=SHORT_SPEC)}
    threads = torch.get_num_threads()
    longest, finishes = 0, collections.Counter()
    try:
        for i, (max_batch, n_threads) in enumerate([(1, 1), (8, 2), (64, 1), (64, 2)]):
            engine = TransformersEngine(world.model, world.tokenizer, max_batch=max_batch)
            for counter, spec in [(c, SPEC) for c in range(4 * i, 4 * i + 4)] + [(100 + i, SHORT_SPEC)]:
                torch.set_num_threads(n_threads)
                env = honest(world, counter, engine=engine, spec=spec)
                torch.set_num_threads(2)  # the validator's own setting
                result = checkers[spec.run_id].check(env)
                assert result.accepted, f"batch {max_batch}, {n_threads} threads, counter {counter}: {result.reason} {result.evidence}"
                longest = max([longest] + [len(r.completion_ids) // 4 for r in env.body.rollouts])
                finishes.update(r.finish for r in env.body.rollouts)
    finally:
        torch.set_num_threads(threads)
    assert finishes.total() == 20 * ROLLOUTS
    # the checks saw long completions and both endings, each many times over (not one lucky draw)
    assert longest > 3 and finishes["eos"] >= 32 and finishes["length"] >= 32, (longest, finishes)


# --- cheats: real worker variants --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "reasons"),
    [
        # sampled with a cheaper model, proofs and log-probs from an honest prefill of the policy:
        # the proofs match, but the seeded sampler on the policy's logits draws other tokens
        ("other-model", {"sampling"}),
        # token 0 changed after generation. It is the input of every later committed row, so the
        # prefill's rows differ from the committed ones (toploc); when the completion is too short
        # for that to move enough top-k values, the replay at position 0 still draws the original
        # token (sampling). Which one fires first depends on the completion, both are evidence.
        ("tampered-token", {"toploc", "sampling"}),
        ("inflated-reward", {"reward"}),
        ("cherry-pick", {"task_mismatch"}),
        # cut short where the policy gives EOS the least probability: P(EOS) < eos_min_prob
        ("fake-eos", {"termination"}),
    ],
)
def test_dishonest_worker_rejected_with_its_reason(world: World, kind: str, reasons: set[str]) -> None:
    blob = build_dishonest_submission(kind, SPEC, RUN, WORKER, world.engine, world.tokenizer, world.tasks, 0, 50)
    result = world.checker().check(opened(blob))
    assert_rejected(result, reasons)
    assert is_cheat(result.reason)
    if kind == "fake-eos":
        assert result.evidence["p_eos"] < SPEC.toploc.eos_min_prob - 0.01
    if kind == "inflated-reward":
        assert result.evidence["reported"] == 1.0 and result.evidence["recomputed"] < 1.0


def test_replayed_counter_rejected_through_the_ledger(world: World, tmp_path: Path) -> None:
    """Counter 0 judged once (at step 1); new content under counter 0 again (at step 0) is a replay."""
    ledger = Judgements(tmp_path / "validator.sqlite")
    try:
        checker = world.checker(trainer_step=1, steps=(0, 1), counter_seen=ledger.counter_seen)
        first = honest(world, counter=0, step=1)
        assert checker.check(first).accepted
        ledger.record(WORKER.peer_id, 0, first.id.hex(), "ok")
        # the adversary forces counter 0 whatever it is asked for; at step 0 its tasks differ
        blob = build_dishonest_submission("replay", SPEC, RUN, WORKER, world.engine, world.tokenizer, world.tasks, 0, 9)
        replay = opened(blob)
        assert replay.body.counter == 0 and replay.body.tasks != first.body.tasks
        result = checker.check(replay)
        assert_rejected(result, {"replay"})
        assert result.evidence == {"counter": 0}
        # judging the same submission again (a re-lease after a crash) is not a replay
        assert checker.check(first).accepted
    finally:
        ledger.close()


@pytest.mark.parametrize(
    ("variant", "reasons"),
    [
        ("random", {"toploc"}),  # a different model of the same shape
        ("perturbed-50%", {"toploc"}),
        # A 3% perturbation keeps the bf16 top-k rows inside TOPLOC's thresholds (built to absorb
        # hardware noise) on this tiny model; its log-probs are off by up to ~2.5 nats per token, far beyond the run spec's
        # 0.01 tolerance, so the log-prob check catches a slightly different model — or, when the
        # perturbation flips a sampled token (the warm-started base of the two-digit addition
        # set is confident enough for that), the sampling replay catches it first.
        ("perturbed-3%", {"logprobs", "sampling"}),
    ],
)
def test_whole_submission_from_another_model_rejected(world: World, variant: str, reasons: set[str]) -> None:
    """Honest worker code run with another model: proofs and log-probs from that model's own passes."""
    if variant == "random":
        other = build_model(world.model.config, seed=999)
    else:
        other = perturbed_model(world.model, float(variant.split("-")[1].rstrip("%")) / 100)
    env = honest(world, counter=60, engine=TransformersEngine(other, world.tokenizer))
    result = world.checker().check(env)
    assert_rejected(result, reasons)


# --- window, checkpoint ------------------------------------------------------------------------


def _first_eos(env: Envelope[Submission]) -> int | None:
    """Index of the first rollout that ended with EOS, if any."""
    return next((j for j, r in enumerate(env.body.rollouts) if r.finish == "eos"), None)


@pytest.fixture(scope="module")
def honest_env(world: World) -> Envelope[Submission]:
    """An accepted honest submission with at least one EOS-ended rollout (the termination edit needs one).

    Which rollouts end with EOS depends on the warm-started weights (their bits differ across
    machines and library versions), so the first of up to 8 submissions that has one is taken
    rather than a fixed counter's rollout 0: no precondition rests on one sampling outcome.
    """
    for counter in range(100, 108):
        env = honest(world, counter=counter)
        if _first_eos(env) is not None:
            assert world.checker().check(env).accepted
            return env
    pytest.fail(f"no rollout of 8 honest submissions ({8 * ROLLOUTS} rollouts) ended with EOS: the warm-started base never stops")


def resealed(env: Envelope[Submission], **changes: Any) -> Envelope[Submission]:
    """The submission with ``changes`` applied, validly signed by the worker again."""
    return opened(seal(WORKER, RUN, env.body.model_copy(update=changes)))


def test_policy_outside_window_is_stale(world: World, honest_env: Envelope[Submission]) -> None:
    # async level 2: at trainer step 3 the oldest usable policy is step 1
    result = world.checker(trainer_step=3).check(honest_env)
    assert_rejected(result, {"stale_policy"})
    assert not is_cheat(result.reason)
    assert result.evidence == {"policy_step": 0, "trainer_step": 3, "async_level": 2}
    assert world.checker(trainer_step=2).check(honest_env).accepted
    # a step the trainer has not reached yet
    future = resealed(honest_env, policy_step=1)
    assert_rejected(world.checker(trainer_step=0).check(future), {"stale_policy"})


def test_checkpoint_that_cannot_be_had(world: World) -> None:
    env = honest(world, counter=3, step=1)
    result = world.checker(trainer_step=1, steps=(0,)).check(env)
    assert_rejected(result, {"unknown_checkpoint"})
    assert not is_cheat(result.reason) and result.evidence == {"policy_step": 1}


# --- malformed and out-of-bounds (hand-edited, validly signed) --------------------------------


def _edit_rollout(env: Envelope[Submission], j: int, **changes: Any) -> Envelope[Submission]:
    rollouts = list(env.body.rollouts)
    rollouts[j] = rollouts[j].model_copy(update=changes)
    return resealed(env, rollouts=rollouts)


def _ids(env: Envelope[Submission], j: int = 0) -> list[int]:
    return unpack_u32(env.body.rollouts[j].completion_ids)


def _too_long(env: Envelope[Submission]) -> Envelope[Submission]:
    n = SPEC.sampling.max_tokens + 1
    return _edit_rollout(env, 0, completion_ids=pack_u32([5] * n), logprobs=pack_f32([-1.0] * n), finish="length",
                         proofs=[b"\x00" * 258])


def _over_vocab(env: Envelope[Submission]) -> Envelope[Submission]:
    ids = _ids(env)
    ids[0] = 100_000
    return _edit_rollout(env, 0, completion_ids=pack_u32(ids))


def _swap_samples(env: Envelope[Submission]) -> Envelope[Submission]:
    rollouts = list(env.body.rollouts)
    rollouts[0], rollouts[1] = rollouts[1], rollouts[0]
    return resealed(env, rollouts=rollouts)


def _eos_declared_length(env: Envelope[Submission]) -> Envelope[Submission]:
    j = _first_eos(env)
    assert j is not None  # honest_env has one
    return _edit_rollout(env, j, finish="length")


MALFORMED: dict[str, tuple[Callable[[Envelope[Submission]], Envelope[Submission]], str]] = {
    "one rollout missing": (lambda e: resealed(e, rollouts=e.body.rollouts[:-1]), "malformed"),
    "one rollout too many": (lambda e: resealed(e, rollouts=[*e.body.rollouts, e.body.rollouts[-1]]), "malformed"),
    "one task too few": (lambda e: resealed(e, tasks=e.body.tasks[:-1]), "task_mismatch"),
    "rollouts out of order": (_swap_samples, "malformed"),
    "token id ≥ vocab": (_over_vocab, "bounds"),
    "completion longer than max_tokens": (_too_long, "bounds"),
    "log-prob count mismatch": (lambda e: _edit_rollout(e, 0, logprobs=e.body.rollouts[0].logprobs[:-4]), "bounds"),
    "NaN log-prob": (lambda e: _edit_rollout(e, 0, logprobs=pack_f32([math.nan] + unpack_f32(e.body.rollouts[0].logprobs)[1:])), "bounds"),
    "positive log-prob": (lambda e: _edit_rollout(e, 0, logprobs=pack_f32([0.5] + unpack_f32(e.body.rollouts[0].logprobs)[1:])), "bounds"),
    "reward above 1": (lambda e: _edit_rollout(e, 0, reward=7.0, task_reward=1.0), "bounds"),
    "proofs missing": (lambda e: _edit_rollout(e, 0, proofs=[]), "malformed"),
    "one proof too many": (lambda e: _edit_rollout(e, 0, proofs=[*e.body.rollouts[0].proofs] * 2), "malformed"),
    "garbage proof bytes": (lambda e: _edit_rollout(e, 0, proofs=[b"\xff" * 7]), "toploc"),
    "EOS-ended but declared length": (_eos_declared_length, "termination"),
    "foreign sampling seed": (lambda e: _edit_rollout(e, 0, seed=e.body.rollouts[0].seed ^ 1), "task_mismatch"),
    "foreign prompt": (lambda e: _edit_rollout(e, 0, prompt_ids=pack_u32([5, 6, 7])), "task_mismatch"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_and_out_of_bounds_rejected(world: World, honest_env: Envelope[Submission], case: str) -> None:
    edit, reason = MALFORMED[case]
    env = edit(honest_env)
    assert env.peer_id == WORKER.peer_id  # opened: the signature is valid
    result = world.checker().check(env)  # never raises on untrusted input
    assert_rejected(result, {reason})
    assert is_cheat(result.reason)


# --- the sampling rule is versioned by the run spec ---------------------------------------------


def test_sampling_rule_named_by_the_run_spec(world: World) -> None:
    """The rule is part of the signed spec: the default ``icdf-v1`` works end to end, and a spec
    naming an unknown rule (the removed ``gumbel-v1`` too) is refused when it is parsed, in one line
    naming the field; the rules the spec accepts are the sampler's."""
    import typing

    from protocol.errors import RunSpecError
    from protocol.runspec import SamplingSpec, parse_run_spec
    from protocol.sampling import RULE_GUMBEL, RULE_ICDF, RULES

    assert SPEC.sampling.rule == RULE_ICDF and RULES == (RULE_ICDF, RULE_GUMBEL)
    assert typing.get_args(SamplingSpec.model_fields["rule"].annotation) == RULES
    assert world.checker().check(honest(world, 70)).accepted
    for rule in ("gumbel-v1", "gumbel-v0"):
        text = f'[run]\ncoordinator = "{COORD.peer_id}"\n[sampling]\nrule = "{rule}"\n'
        with pytest.raises(RunSpecError, match=r"^run spec field sampling\.rule: .*'icdf-v1'") as e:
            parse_run_spec(text, require_signature=False)
        assert "\n" not in str(e.value)


# --- the log-prob tolerances are the run spec's ------------------------------------------------


def _with_logprob_tolerances(max_abs: float, mean_abs: float) -> RunSpec:
    """``SPEC`` with other ``toploc.logprob_*`` tolerances (same tasks, seeds and sampling; another run ID)."""
    return RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl,
                   toploc=ToplocSpec(logprob_max_abs=max_abs, logprob_mean_abs=mean_abs))


def _logprobs_shifted(env: Envelope[Submission], spec: RunSpec, shift: Callable[[int, int], float]) -> Envelope[Submission]:
    """Rollout 0 with log-prob ``i`` of ``n`` lowered by ``shift(i, n)`` nats, signed by the worker in ``spec``'s run."""
    lps = unpack_f32(env.body.rollouts[0].logprobs)
    n = len(lps)
    rollouts = list(env.body.rollouts)
    rollouts[0] = rollouts[0].model_copy(update={"logprobs": pack_f32([x - shift(i, n) for i, x in enumerate(lps)])})
    return open_envelope(seal(WORKER, spec.run_id, env.body.model_copy(update={"rollouts": rollouts})), run_id=spec.run_id, expect=Submission)


def test_logprob_tolerances_come_from_the_run_spec(world: World, honest_env: Envelope[Submission]) -> None:
    """Log-probs off by more than the spec's tolerance are rejected, within it accepted, for
    non-default ``toploc.logprob_max_abs`` / ``logprob_mean_abs``: the values are the run spec's."""
    assert (SPEC.toploc.logprob_max_abs, SPEC.toploc.logprob_mean_abs) == (1e-2, 1e-3)  # the defaults

    def check(spec: RunSpec, env: Envelope[Submission]) -> CheckResult:
        return SubmissionChecker(spec, world.tasks, world.tokenizer, lambda s: world.model, trainer_step=lambda: 0,
                                 counter_seen=lambda w, c, sid: False).check(env)

    # the last token 0.05 nats off: beyond the default max (0.01), within a run's max of 0.1
    n = len(unpack_f32(honest_env.body.rollouts[0].logprobs))
    def last(i: int, count: int) -> float:
        return 0.05 if i == count - 1 else 0.0

    result = check(SPEC, _logprobs_shifted(honest_env, SPEC, last))
    assert_rejected(result, {"logprobs"})
    assert is_cheat(result.reason)
    assert result.evidence["rollout"] == 0 and result.evidence["position"] == n - 1
    assert result.evidence["max_abs_diff"] == pytest.approx(0.05, abs=1e-4)
    loose = _with_logprob_tolerances(0.1, 0.05)
    assert check(loose, _logprobs_shifted(honest_env, loose, last)).accepted
    tighter = _with_logprob_tolerances(0.04, 0.04)
    assert_rejected(check(tighter, _logprobs_shifted(honest_env, tighter, last)), {"logprobs"})
    # every token 0.005 off: inside the default max, beyond the default mean (0.001); a run with
    # a mean tolerance of 0.008 accepts it, one with 0.004 does not
    def every(i: int, count: int) -> float:
        return 0.005

    result = check(SPEC, _logprobs_shifted(honest_env, SPEC, every))
    assert_rejected(result, {"logprobs"})
    assert result.evidence["mean_abs_diff"] == pytest.approx(0.005, abs=1e-4) and "mean" in str(result.evidence["detail"])
    assert result.evidence["max_abs_diff"] < SPEC.toploc.logprob_max_abs
    mean_ok = _with_logprob_tolerances(0.01, 0.008)
    assert check(mean_ok, _logprobs_shifted(honest_env, mean_ok, every)).accepted
    mean_bad = _with_logprob_tolerances(0.01, 0.004)
    assert_rejected(check(mean_bad, _logprobs_shifted(honest_env, mean_bad, every)), {"logprobs"})
    # the unedited submission passes under every one of these runs
    for spec in (loose, tighter, mean_ok, mean_bad):
        assert check(spec, _logprobs_shifted(honest_env, spec, lambda i, n: 0.0)).accepted


def test_replay_tolerances_come_from_the_run_spec(world: World, honest_env: Envelope[Submission], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampling replay applies the signed spec's replay rule and tolerances (``toploc.replay_eps``,
    ``max_near_tie_fraction``, ``eos_prob_slack``; ``replay_rule`` and ``replay_logit_bound``: a
    bf16-compute run names logit-bound-v1; every validator of the run and the coordinator's re-check
    must apply the same ones), not constants of the validator: one ``ReplayParams`` from the spec."""
    from protocol import sampling

    seen: list[tuple[Any, ...]] = []
    real = sampling.replay_checks

    def spy(*args: Any, **kwargs: Any) -> Any:  # the run's parameters: one typed value, the fourth argument
        p = args[3]
        seen.append((p.eps, p.max_near_tie_fraction, p.eos_prob_slack, p.replay_rule, p.logit_bound))
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "replay_checks", spy)
    assert (SPEC.toploc.replay_eps, SPEC.toploc.max_near_tie_fraction, SPEC.toploc.replay_rule) == (1e-4, 0.1, "eps-v1")  # the defaults
    for toploc_spec, want in ((ToplocSpec(replay_eps=0.03, max_near_tie_fraction=0.4, eos_prob_slack=0.02), (0.03, 0.4, 0.02, "eps-v1", 0.0)),
                              (ToplocSpec(replay_rule="logit-bound-v1", replay_logit_bound=0.5), (1e-4, 0.1, 0.01, "logit-bound-v1", 0.5))):
        seen.clear()
        spec = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc_spec)
        env = open_envelope(seal(WORKER, spec.run_id, honest_env.body), run_id=spec.run_id, expect=Submission)
        result = SubmissionChecker(spec, world.tasks, world.tokenizer, lambda s: world.model, trainer_step=lambda: 0,
                                   counter_seen=lambda w, c, sid: False).check(env)
        assert result.accepted and seen and set(seen) == {want}


def test_oversized_packed_arrays_are_refused_before_they_are_unpacked(world: World, honest_env: Envelope[Submission],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 M tokens of completion and log-probs, or of prompt, in one validly signed rollout: refused on
    # their byte sizes (old code: made 1-2 M Python numbers first, ≈ 0.7 s and 48 MiB per rollout)
    import validator.pipeline as vp

    seen: list[int] = []
    for name in ("unpack_u32", "unpack_f32"):
        def spy(data: bytes, real: Callable[[bytes], Any] = getattr(vp, name)) -> Any:
            seen.append(len(data))
            return real(data)

        monkeypatch.setattr(vp, name, spy)
    big = 4 << 20  # bytes: 1 M uint32 / float32
    for env, reason in ((_edit_rollout(honest_env, 0, completion_ids=bytes(big), logprobs=bytes(big)), "bounds"),
                        (_edit_rollout(honest_env, 0, prompt_ids=bytes(big)), "task_mismatch")):
        seen.clear()
        assert_rejected(world.checker().check(env), {reason})
        assert max(seen, default=0) < big, seen


@pytest.mark.parametrize("full", [False, True])
def test_a_submissions_reward_work_stops_at_its_budget(world: World, honest_env: Envelope[Submission], monkeypatch: pytest.MonkeyPatch,
                                                        full: bool) -> None:
    # completions that sleep to just under every sandbox limit and report the reward the sandbox then gives (0, agreeing):
    # a light check runs the rewards of tokens nobody checked, and each rollout cost ≈ 60 s of a code task's sandbox time
    # (measured: a sleeping program, 15.2 s for its first test case), all of them in turn (old code: 16 rollouts, 960 s, accepted)
    import validator.pipeline as vp
    from protocol.rewards import RewardLimits
    from validator.rewards import RewardJudgement

    clock = [0.0]
    scored: list[int] = []

    def slow_agreeing_judge(score: Callable[[], Any], reported_task: float, reported_reward: float, **_: Any) -> RewardJudgement:
        scored.append(1)
        clock[0] += RewardLimits().sandbox.total_wall_time_s  # a completion at its whole sandbox time
        return RewardJudgement("ok", None, 1, "")  # type: ignore[arg-type]

    monkeypatch.setattr(vp.rewards, "_clock", lambda: clock[0])
    monkeypatch.setattr(vp, "judge_reward", slow_agreeing_judge)
    budget = vp.reward_budget_s(ROLLOUTS, RewardLimits())
    assert budget == 120.0  # two completions' sandbox time: 16 rollouts × 2 s is less
    result = world.checker().check(honest_env, full=full)
    assert_rejected(result, {"limit_hit"})
    assert len(scored) == 3 < ROLLOUTS and result.evidence["budget_s"] == budget  # 0 → 60 → 120 → 180 s: over after the third
    assert vp.reward_budget_s(1000, RewardLimits()) == 2000.0  # large submissions get 2 s a rollout


def test_the_sampling_check_runs_on_one_intra_op_thread(world: World, honest_env: Envelope[Submission], monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay runs on one torch thread (its short parallel ops stall beside other CPU-bound
    processes: docs/toploc.md §9) and the process's thread count is back afterwards."""
    from protocol import sampling

    seen: list[int] = []
    real = sampling.replay_checks

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "replay_checks", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert world.checker().check(honest_env).accepted
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_verdicts_carry_the_replay_statistics_of_the_whole_submission(world: World, honest_env: Envelope[Submission]) -> None:
    """An accepted full check returns the statistics the audit counts: every completion token replayed,
    every TOPLOC chunk, an honest float32 worker's tokens all the replay's; a light check has none."""
    result = world.checker().check(honest_env)
    assert result.accepted and result.stats is not None
    lengths = [len(unpack_u32(ro.completion_ids)) for ro in honest_env.body.rollouts]
    s = result.stats
    assert s.tokens == sum(lengths) and s.chunks == sum(-(-n // SPEC.toploc.chunk_size) for n in lengths)
    assert (s.differ, s.impossible, s.logprob_over, s.chunks_over) == (0, 0, 0, 0) and s.gap_over == [0] * 5
    assert world.checker().check(honest_env, full=False).stats is None


def test_logit_bound_v2_rejects_a_value_within_the_hard_factor_as_precision_beyond_it_as_a_cheat(world: World) -> None:
    """Under ``logit-bound-v2`` a log-prob beyond its bound but within ``hard_factor`` of it is a
    benign ``precision`` rejection carrying the statistics (one honest worker's rare numeric tail
    never bans it; the audit counts it), beyond the factor the ``logprobs`` cheat it always was;
    the same edit under ``logit-bound-v1`` is a cheat either way."""
    from protocol.verdicts import BENIGN_REASONS

    toploc = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=0.5, logprob_max_abs=0.1, logprob_mean_abs=0.1, hard_factor=2.0)
    v2 = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc)
    v1 = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl,
                 toploc=toploc.model_copy(update={"replay_rule": "logit-bound-v1", "hard_factor": 2.0}))
    env = honest(world, 40, spec=v2)
    assert world.checker(spec=v2).check(env).accepted

    def last(shift: float) -> Callable[[int, int], float]:
        return lambda i, n: shift if i == n - 1 else 0.0

    soft = world.checker(spec=v2).check(_logprobs_shifted(env, v2, last(0.15)))
    assert soft.reason == "precision" and "precision" in BENIGN_REASONS and not is_cheat("precision")
    assert soft.evidence["finding"] == "logprobs" and soft.stats is not None and soft.stats.logprob_over == 1
    assert_rejected(world.checker(spec=v2).check(_logprobs_shifted(env, v2, last(0.25))), {"logprobs"})
    env1 = honest(world, 40, spec=v1)
    assert_rejected(world.checker(spec=v1).check(_logprobs_shifted(env1, v1, last(0.15))), {"logprobs"})


def test_logit_bound_v3_judges_one_tokens_log_prob_tail_soft_and_a_shaded_submission_hard(world: World) -> None:
    """``logit-bound-v3`` (docs/toploc.md §6.4): one token's log-prob off by 4.25 nats — what two 40-step bf16
    devnets under ``-v2`` saw from honest workers at an attention flip, and banned them for — is a benign
    ``precision`` finding, where ``-v2`` still calls the same edit the ``logprobs`` cheat (old specs keep their
    meaning); log-probs shaded at every token of the submission beyond ``hard_factor`` × the mean bound are the
    cheat."""
    toploc = ToplocSpec(replay_rule="logit-bound-v3", replay_logit_bound=0.5, logprob_max_abs=0.1, logprob_mean_abs=0.1, hard_factor=2.0)
    v3 = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc)
    v2 = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc.model_copy(update={"replay_rule": "logit-bound-v2"}))
    env = honest(world, 41, spec=v3)
    assert world.checker(spec=v3).check(env).accepted
    one_token = _logprobs_shifted(env, v3, lambda i, n: 4.25 if i == n - 1 else 0.0)
    soft = world.checker(spec=v3).check(one_token)
    assert soft.reason == "precision" and soft.evidence["finding"] == "logprobs", (soft.reason, soft.evidence)
    env2 = honest(world, 41, spec=v2)
    assert_rejected(world.checker(spec=v2).check(_logprobs_shifted(env2, v2, lambda i, n: 4.25 if i == n - 1 else 0.0)), {"logprobs"})
    rollouts = [r.model_copy(update={"logprobs": pack_f32([x - 0.25 for x in unpack_f32(r.logprobs)])}) for r in env.body.rollouts]
    shaded = opened(seal(WORKER, v3.run_id, env.body.model_copy(update={"rollouts": rollouts})), v3.run_id)
    hard = world.checker(spec=v3).check(shaded)
    assert_rejected(hard, {"logprobs"})
    assert hard.evidence["mean_abs_diff"] == pytest.approx(0.25, abs=0.01) and hard.evidence["max_submission_mean"] == pytest.approx(0.2)
    # a non-finite log-prob never reaches the soft path: refused on its bounds first
    assert_rejected(world.checker(spec=v3).check(_logprobs_shifted(env, v3, lambda i, n: math.inf if i == 0 else 0.0)), {"bounds"})


def test_logit_bound_v3_one_tokens_tail_is_soft_up_to_the_submissions_whole_mean_budget_and_evidence_stays_finite(world: World) -> None:
    """A hostile worker under ``logit-bound-v3`` may put the whole submission's mean budget on one token: with
    hard_factor 2 and logprob_mean_abs 0.1 over T tokens, one log-prob off by up to 0.2·T nats is the benign
    ``precision`` (never accepted, never a ban: the soft path hides nothing from training), beyond it the
    ``logprobs`` cheat; a finite but absurd value (3e38 nats, float32's edge) is the cheat, and every evidence
    field is a finite number that JSON writes without NaN/inf."""
    toploc = ToplocSpec(replay_rule="logit-bound-v3", replay_logit_bound=0.5, logprob_max_abs=0.1, logprob_mean_abs=0.1, hard_factor=2.0)
    v3 = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc)
    env = honest(world, 43, spec=v3)
    tokens = sum(len(unpack_f32(r.logprobs)) for r in env.body.rollouts)
    for shift, reason in ((0.2 * tokens - 0.05, "precision"), (0.2 * tokens + 0.05, "logprobs"), (3e38, "logprobs")):
        result = world.checker(spec=v3).check(_logprobs_shifted(env, v3, lambda i, n, s=shift: s if i == 0 else 0.0))
        assert result.reason == reason, (shift, tokens, result.reason, result.evidence)
        assert result.evidence.get("finding", "logprobs") == "logprobs"
        json.dumps(result.evidence, allow_nan=False)
        if reason == "logprobs":
            assert result.evidence["tokens"] == tokens and result.evidence["mean_abs_diff"] > 0.2


def test_a_gumbel_run_is_replayed_by_its_own_rule(world: World) -> None:
    """A run naming ``sampling.rule = "gumbel-v2"`` (with its logit replay rule) is generated and replayed by
    that rule: an honest worker's submission is accepted with every check run, and the same tasks decoded by
    ``icdf-v1`` and signed for the Gumbel run are rejected as a sampling cheat (the validator's replay
    follows the signed spec's rule, not a default)."""
    toploc = ToplocSpec(replay_rule="logit-bound-v1", replay_logit_bound=0.5)  # v1: a token beyond the bound is a cheat, not a soft finding
    gumbel = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling.model_copy(update={"rule": "gumbel-v2"}), rl=SPEC.rl,
                     toploc=toploc)
    icdf = RunSpec(run=SPEC.run, data=SPEC.data, sampling=SPEC.sampling, rl=SPEC.rl, toploc=toploc)
    checker = world.checker(spec=gumbel)
    result = checker.check(honest(world, counter=300, spec=gumbel))
    assert result.accepted, (result.reason, result.evidence)
    other = honest(world, counter=300, spec=icdf)
    forged = opened(seal(WORKER, gumbel.run_id, other.body), gumbel.run_id)
    assert_rejected(checker.check(forged), {"sampling"})
    # under logit-bound-v2 a finite gap beyond δ, of any size, is a benign precision finding (docs/toploc.md §6.3)
    soft = RunSpec(run=SPEC.run, data=SPEC.data, sampling=gumbel.sampling, rl=SPEC.rl,
                   toploc=ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=0.5))
    result = world.checker(spec=soft).check(opened(seal(WORKER, soft.run_id, other.body), soft.run_id))
    assert not result.accepted and result.reason == "precision" and result.evidence["finding"] == "sampling", result.evidence
