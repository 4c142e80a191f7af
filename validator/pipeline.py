"""The verification pipeline of one submission, cheapest checks first (``docs/validator.md``).

Order: banned → policy window → replay → task derivation (tasks, targets, prompts, seeds) →
format and bounds → declared termination → TOPLOC by batched prefill → termination (P(EOS)),
sampling replay and log-probs (a few rollouts' logits at a time) → rewards. A light check
(``check(full=False)``, spot checks: :mod:`validator.spot`) skips the model work, from TOPLOC to
log-probs. The first failing check decides the verdict; its
reason code (``protocol.verdicts``) and evidence (which rollout, which chunk, the numbers) go
into the signed verdict. Failures that may be the validator's own or a resource limit of either
side get benign reasons (``reward_error``, ``limit_hit``, ``unknown_checkpoint``:
``protocol.verdicts.BENIGN_REASONS``), never a cheat reason; so does a reward disagreement
that does not reproduce (``nondeterministic``, :mod:`validator.rewards`), and a run's environment
whose own reward code fails or does not reproduce (``environment``).

The model work (prefill) uses :func:`protocol.inference.completion_rows` and
:func:`protocol.inference.head_logits` (the two halves of ``prefill_completions``), the very code
whose rows the worker's engine commits, and the reward work :func:`protocol.rewards.compute_reward`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol import sampling, toploc
from protocol.envelope import Envelope
from protocol.inference import completion_rows, head_logits, logits_buffer
from protocol.messages import Submission
from protocol.models import config_int
from protocol.rewards import RewardError, RewardLimits, compute_reward
from protocol.rollout import completion_text, plan_submission, unpack_f32, unpack_u32
from protocol.runspec import RunSpec
from protocol.tasks import ENV_TASK_TYPE, Task
from protocol.verdicts import OK
from protocol.window import in_window
from validator.rewards import judge_reward

logger = logging.getLogger(__name__)

Evidence = dict[str, bool | int | float | str]


@dataclass
class CheckResult:
    """The outcome of checking one submission.

    Attributes:
        accepted: whether every check passed.
        reason: ``"ok"`` or the first failing check's reason code.
        evidence: what was seen (rollout index, chunk, numbers), at most a few dozen entries.
        seconds: wall time spent, seconds.
        timings: seconds per stage.
    """

    accepted: bool
    reason: str
    evidence: Evidence = field(default_factory=dict)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class Rejection(Exception):
    """Raised inside the pipeline to stop at the first failing check."""

    def __init__(self, reason: str, **evidence: bool | float | str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.evidence = evidence


@dataclass(frozen=True)
class Tolerances:
    """Numeric tolerances of the sampling checks (``docs/toploc.md``) that are the validator's own.

    The log-prob and replay tolerances are not here: every node of a run applies the signed run
    spec's ``toploc.logprob_max_abs`` / ``logprob_mean_abs`` (:func:`protocol.sampling.logprob_check`)
    and the replay rule with its tolerances ``toploc.replay_rule``, ``replay_eps``, ``eos_prob_slack``,
    ``replay_logit_bound``, ``max_near_tie_fraction`` (:func:`protocol.sampling.replay_checks`).

    Attributes:
        reward_tol: reported vs recomputed reward, absolute.
    """

    reward_tol: float = 1e-6


class SubmissionChecker:
    """Checks submissions of one run against a loaded policy.

    Args:
        spec: the run spec.
        tasks: the run's dataset in canonical order.
        tokenizer: the policy's tokenizer.
        model_for_step: returns the policy model of a step, or ``None`` if it cannot be had.
        trainer_step: returns the coordinator's trainer step ``n`` (:mod:`protocol.window`; the window's upper end).
        counter_seen: returns whether (worker, counter) was already judged in another submission.
        tolerances: numeric tolerances.
        reward_limits: sandbox limits for code rewards.
        replay_threads: torch intra-op threads for the sampling check (termination, replay,
            log-probs; the prefill and LM head keep the process's); ``None``: the process's.
            Default 1: the check is many short memory-bound passes over each position's logits,
            and beside other CPU-bound processes every parallel op waits for a descheduled
            thread. ``benchmarks/validator_bench.py`` checks each submission both ways (vocabulary
            151,936, 2 threads, 4 Dec 2026): beside two CPU-bound processes the check took 7.56 s
            on 2 threads and 1.45 s on 1 (sampling / prefill 0.48 → 0.076); on a quiet machine
            0.20 s and 0.30 s (0.074 → 0.105, both within the 1/4 goal) (``docs/toploc.md`` §9).
    """

    def __init__(
        self,
        spec: RunSpec,
        tasks: Sequence[Task],
        tokenizer: Any,
        model_for_step: Callable[[int], torch.nn.Module | None],
        *,
        trainer_step: Callable[[], int],
        counter_seen: Callable[[str, int, str], bool],
        tolerances: Tolerances | None = None,
        reward_limits: RewardLimits | None = None,
        replay_threads: int | None = 1,
    ) -> None:
        self.spec = spec
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.model_for_step = model_for_step
        self.trainer_step = trainer_step
        self.counter_seen = counter_seen
        self.tol = tolerances or Tolerances()
        self.reward_limits = reward_limits
        self.replay_threads = replay_threads
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)

    def check(self, env: Envelope[Submission], *, full: bool = True) -> CheckResult:
        """Run the checks on a verified envelope; never raises on bad submissions.

        Args:
            env: the submission.
            full: every check (default); ``False``: a light check, everything that needs no
                model — window, replay, task derivation, format and bounds, declared
                termination, rewards — for the submissions a spot-checking validator does not
                check in full (:mod:`validator.spot`).
        """
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        try:
            self._check(env, timings, full)
        except Rejection as r:
            return CheckResult(False, r.reason, dict(list(r.evidence.items())[:32]), time.perf_counter() - t0, timings)
        return CheckResult(True, OK, {}, time.perf_counter() - t0, timings)

    # --- the stages --------------------------------------------------------------------------

    def _check(self, env: Envelope[Submission], timings: dict[str, float], full: bool = True) -> None:
        sub = env.body
        spec = self.spec
        # policy window
        now = self.trainer_step()
        if not in_window(sub.policy_step, trainer_step=now, async_level=spec.rl.async_level):
            raise Rejection("stale_policy", policy_step=sub.policy_step, trainer_step=now, async_level=spec.rl.async_level)
        # replay
        if self.counter_seen(sub.worker, sub.counter, env.id.hex()):
            raise Rejection("replay", counter=sub.counter)
        # task derivation
        t = time.perf_counter()
        plan = plan_submission(spec, self.tasks, self.tokenizer, sub.worker, sub.policy_step, sub.counter)
        if len(sub.tasks) != len(plan):
            raise Rejection("task_mismatch", tasks=len(sub.tasks), expected=len(plan))
        for i, (got, want) in enumerate(zip(sub.tasks, plan)):
            if got.task_index != want.task_index or got.problem_id != want.task.problem_id[:256] or got.target_length != (want.target_length or 0):
                raise Rejection("task_mismatch", task=i, task_index=got.task_index, expected_index=want.task_index)
        g = spec.rl.group_size
        if len(sub.rollouts) != g * len(plan):
            raise Rejection("malformed", rollouts=len(sub.rollouts), expected=g * len(plan))
        seqs = []
        for j, ro in enumerate(sub.rollouts):
            p = plan[j // g]
            if ro.task != p.position or ro.sample != j % g:
                raise Rejection("malformed", rollout=j, detail="rollouts must be task-major, samples 0..G-1")
            if ro.seed != p.seeds[ro.sample]:
                raise Rejection("task_mismatch", rollout=j, detail="sampling seed is not the derived one")
            # sizes before values: a 4 MiB packed array is 1 M Python ints (≈ 0.3 s, 40 MB)
            if len(ro.prompt_ids) != 4 * len(p.prompt_ids):
                raise Rejection("task_mismatch", rollout=j, detail="prompt tokens are not the derived prompt")
            prompt = unpack_u32(ro.prompt_ids)
            if tuple(prompt) != p.prompt_ids:
                raise Rejection("task_mismatch", rollout=j, detail="prompt tokens are not the derived prompt")
            seqs.append(self._bounds(j, ro, prompt))
        timings["derive"] = time.perf_counter() - t
        if full:
            self._model_checks(sub, seqs, timings)
        self._rewards(sub, plan, seqs, timings)

    def _model_checks(self, sub: Submission, seqs: list[tuple[list[int], list[int], list[float]]], timings: dict[str, float]) -> None:
        """The checks that need the policy: TOPLOC on the batched prefill, termination by the policy,
        sampling replay and log-probs."""
        spec = self.spec
        model = self.model_for_step(sub.policy_step)
        if model is None:
            raise Rejection("unknown_checkpoint", policy_step=sub.policy_step)
        model_vocab = config_int(model, "vocab_size")
        for j, (_, completion, _) in enumerate(seqs):
            if max(completion) >= model_vocab:
                raise Rejection("bounds", rollout=j, token=max(completion), vocab_size=model_vocab)
        t = time.perf_counter()
        rows = completion_rows(model, [s[0] for s in seqs], [s[1] for s in seqs], self.pad_id)  # [n, H] per rollout
        timings["prefill"] = time.perf_counter() - t
        t = time.perf_counter()
        verdicts = toploc.verify_proofs_many(  # every rollout's chunks at once
            [row.to(torch.bfloat16) for row in rows], [list(ro.proofs) for ro in sub.rollouts], chunk_size=spec.toploc.chunk_size,
            topk=spec.toploc.topk, max_mismatches=spec.toploc.max_mismatches, max_mant_err_mean=spec.toploc.max_mant_err_mean,
            max_mant_err_median=spec.toploc.max_mant_err_median,
        )
        for j, results in enumerate(verdicts):
            bad = next((r for r in results if not r.ok), None)
            if bad is not None:
                raise Rejection("toploc", rollout=j, chunk=bad.index, mismatches=bad.mismatches,
                                mant_err_mean=_finite(bad.mant_err_mean), mant_err_median=_finite(bad.mant_err_median), detail=bad.reason[:200])
        timings["toploc"] = time.perf_counter() - t
        t = time.perf_counter()
        # the logits (the prefill's LM head) of a few consecutive rollouts at a time go into one reused
        # buffer and are checked at once, while hot in cache: fresh [n, V] pages for every rollout cost
        # ~10 % of the LM head at a 151,936 vocabulary, and one check per short rollout its per-call overhead
        groups = _logit_groups([len(s[1]) for s in seqs], model_vocab)
        head_s, buf = 0.0, logits_buffer(model, max(sum(len(seqs[j][1]) for j in g) for g in groups))
        for group in groups:
            t_head = time.perf_counter()
            logits = head_logits(model, torch.cat([rows[j] for j in group]) if len(group) > 1 else rows[group[0]], buf)  # [Σn, V] float32
            head_s += time.perf_counter() - t_head
            with _intra_op_threads(self.replay_threads):
                self._sampling(group, [sub.rollouts[j].seed for j in group], logits, [seqs[j][1] for j in group],
                               [seqs[j][2] for j in group])
        timings["prefill"] += head_s  # the LM head is prefill work, done group by group
        timings["sampling"] = time.perf_counter() - t - head_s

    def _rewards(self, sub: Submission, plan: Any, seqs: list[tuple[list[int], list[int], list[float]]], timings: dict[str, float]) -> None:
        spec = self.spec
        g = spec.rl.group_size
        t = time.perf_counter()
        limits = self.reward_limits or RewardLimits()
        for j, (ro, (_, completion, _)) in enumerate(zip(sub.rollouts, seqs)):
            p = plan[j // g]
            text = completion_text(self.tokenizer, completion, self.eos_id)
            try:  # a disagreement counts as a cheat only when it reproduces (validator/rewards.py)
                score = functools.partial(compute_reward, p.task, text, len(completion), p.target_length, spec.sampling.length_penalty, limits)
                judged = judge_reward(score, ro.task_reward, ro.reward, reward_tol=self.tol.reward_tol, budget_s=limits.sandbox.total_wall_time_s,
                                      environment=p.task.task_type == ENV_TASK_TYPE)
            except RewardError as e:  # our failure to score, not evidence about the worker
                raise Rejection("reward_error", rollout=j, detail=str(e)[:200]) from None
            if judged.reason != OK:
                r = judged.result
                raise Rejection(judged.reason, rollout=j, reported=ro.reward, recomputed=r.reward, reported_task=ro.task_reward,
                                recomputed_task=r.task_reward, runs=judged.runs, detail=(judged.detail or r.detail)[:200])
        timings["reward"] = time.perf_counter() - t

    def _bounds(self, j: int, ro: Any, prompt: list[int]) -> tuple[list[int], list[int], list[float]]:
        spec = self.spec
        if not 1 <= len(ro.completion_ids) // 4 <= spec.sampling.max_tokens:  # before 1 M tokens become Python ints
            raise Rejection("bounds", rollout=j, length=len(ro.completion_ids) // 4, max_tokens=spec.sampling.max_tokens)
        if len(ro.logprobs) != len(ro.completion_ids):
            raise Rejection("bounds", rollout=j, detail="one finite log-prob ≤ 0 per completion token")
        completion = unpack_u32(ro.completion_ids)
        logprobs = unpack_f32(ro.logprobs)
        n = len(completion)
        vocab = int(getattr(self.tokenizer, "vocab_size", 0) or 0)
        if not 1 <= n <= spec.sampling.max_tokens:
            raise Rejection("bounds", rollout=j, length=n, max_tokens=spec.sampling.max_tokens)
        if vocab and max(completion) >= max(vocab, len(self.tokenizer)):
            raise Rejection("bounds", rollout=j, token=max(completion))
        if len(logprobs) != n or not all(math.isfinite(x) and x <= 0.0 for x in logprobs):
            raise Rejection("bounds", rollout=j, detail="one finite log-prob ≤ 0 per completion token")
        want_proofs = -(-n // spec.toploc.chunk_size)
        if len(ro.proofs) != want_proofs:
            raise Rejection("malformed", rollout=j, proofs=len(ro.proofs), expected=want_proofs)
        lo = -spec.sampling.length_penalty * (spec.sampling.max_tokens + max(spec.sampling.target_lengths, default=0))
        if not (0.0 <= ro.task_reward <= 1.0 and lo - 1e-9 <= ro.reward <= 1.0):
            raise Rejection("bounds", rollout=j, reward=ro.reward, task_reward=ro.task_reward)
        eos_at = [i for i, tok in enumerate(completion) if tok == self.eos_id]
        if ro.finish == "eos" and eos_at != [n - 1]:
            raise Rejection("termination", rollout=j, detail="finish=eos needs exactly one EOS, at the end")
        if ro.finish == "length" and (eos_at or n != spec.sampling.max_tokens):
            raise Rejection("termination", rollout=j, length=n, detail="finish=length needs max_tokens tokens and no EOS")
        return prompt, completion, logprobs

    def _sampling(self, group: list[int], seeds: list[int], logits: torch.Tensor, completions: list[list[int]], logprobs: list[list[float]]) -> None:
        """Termination by the policy, sampling replay and log-probs of consecutive rollouts ``group``
        whose logits are stacked in ``logits`` (``[Σn, V]``, this group's scratch: the replay works in it)."""
        s, t = self.spec.sampling, self.spec.toploc
        eos_floor = t.eos_min_prob
        slack = sampling.termination_slack(eos_floor, s.temperature, t.replay_rule, t.eos_prob_slack, t.replay_logit_bound)
        end = 0
        # termination first: a stop where the policy gives EOS little probability is the specific cheat
        for j, completion in zip(group, completions, strict=True):
            end += len(completion)
            term = sampling.termination_check(logits[end - 1], completion, [self.eos_id], s.max_tokens, s.temperature, eos_floor, slack)
            if not term.ok:
                raise Rejection("termination", rollout=j, p_eos=_finite(term.p_eos), min_p_eos=eos_floor, detail=term.reason[:200])
        replays = sampling.replay_checks(logits, completions, seeds, None, s.temperature, s.top_p, t.replay_eps, t.max_near_tie_fraction,
                                         eos_ids=(self.eos_id,), min_eos_prob=eos_floor, eos_prob_slack=t.eos_prob_slack, rule=s.rule,
                                         overwrite=True, replay_rule=t.replay_rule, logit_bound=t.replay_logit_bound)
        for j, replay, reported in zip(group, replays, logprobs, strict=True):
            if not replay.ok:
                raise Rejection("sampling", rollout=j, hard_mismatches=replay.hard_mismatches, near_ties=replay.near_ties,
                                detail=replay.reason[:200])
            assert replay.logprobs is not None  # replay_checks always fills them: [n] log_softmax(logits / T)[token]
            lp = sampling.logprob_check(reported, replay.logprobs, max_abs=t.logprob_max_abs, mean_abs=t.logprob_mean_abs)
            if not lp.ok:
                raise Rejection("logprobs", rollout=j, position=lp.position, max_abs_diff=_finite(lp.max_abs_err),
                                mean_abs_diff=_finite(lp.mean_abs_err), detail=lp.reason[:200])


_LOGIT_GROUP_ELEMENTS = 1 << 22
"""Logits checked together at most (16 MiB of float32): consecutive rollouts are grouped up to this,
a longer rollout goes alone."""


def _logit_groups(lengths: list[int], vocab: int) -> list[list[int]]:
    """Consecutive rollout indices whose stacked ``[Σn, V]`` logits stay within :data:`_LOGIT_GROUP_ELEMENTS`."""
    groups: list[list[int]] = []
    rows = 0
    for j, n in enumerate(lengths):
        if groups and (rows + n) * vocab <= _LOGIT_GROUP_ELEMENTS:
            groups[-1].append(j)
            rows += n
        else:
            groups.append([j])
            rows = n
    return groups


@contextlib.contextmanager
def _intra_op_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block (``None``: unchanged), then restored."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e9
