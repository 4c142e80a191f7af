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
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol import sampling, toploc
from protocol.audit import TWINS_PER_SUBMISSION
from protocol.envelope import Envelope
from protocol.inference import completion_rows, head_logits, logits_buffer
from protocol.messages import ReplayStats, Submission
from protocol.models import config_int
from protocol.rewards import RewardError, RewardLimits, compute_reward
from protocol.rollout import completion_text, plan_submission, unpack_f32, unpack_u32
from protocol.runspec import AUDIT_RULE_EPROCESS_V2, REPLAY_RULE_LOGIT_BOUND_V3, RunSpec
from protocol.tasks import ENV_TASK_TYPE, Task
from protocol.verdicts import OK, PRECISION
from protocol.window import in_window
from validator import rewards
from validator.rewards import judge_reward
from validator.twins import decode_twins

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
        stats: the replay statistics of the model checks (accepted and ``precision`` verdicts of
            full checks; ``None`` otherwise), signed into the verdict for the per-worker audit.
        extremes: with ``stats``, the largest value of each toleranced quantity the model checks
            saw (:data:`EXTREMES`): what ``spec init --measure-precision`` sets the bounds from.
    """

    accepted: bool
    reason: str
    evidence: Evidence = field(default_factory=dict)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    stats: ReplayStats | None = None
    extremes: dict[str, float] = field(default_factory=dict)


EXTREMES = ("gap", "logprob_abs", "logprob_mean_abs", "toploc_mismatches", "toploc_mant_err_mean", "toploc_mant_err_median", "eos_shortfall")
"""The quantities :attr:`CheckResult.extremes` reports the largest of: the replay gap of a differing token
(finite; the rule's units), the per-token and per-completion log-prob differences (nats), a TOPLOC chunk's
mismatches and mantissa errors, and how far below the EOS floor a recomputed P(EOS) at a stop lay."""


class Rejection(Exception):
    """Raised inside the pipeline to stop at the first failing check."""

    def __init__(self, reason: str, *, tally: _Tally | None = None, **evidence: bool | float | str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.evidence = evidence
        self.tally = tally


@dataclass
class _Tally:
    """The replay statistics of one submission as the model checks go, and its soft findings:
    values beyond a bound but within the hard factor under ``logit-bound-v2`` (``docs/toploc.md`` §6.3)."""

    edges: tuple[float, ...]
    tokens: int = 0
    differ: int = 0
    gap_over: list[int] = field(default_factory=lambda: [0] * len(sampling.GAP_EDGE_FRACTIONS))
    impossible: int = 0
    near_ties: int = 0
    logprob_over: int = 0
    logprob_abs_sum: float = 0.0  # Σ |reported − recomputed| over the submission's tokens, nats (logit-bound-v3's hard test)
    chunks: int = 0
    chunks_over: int = 0
    twins: bool = False  # eprocess-v2: count rollouts, diverged ones and their twins' outcomes
    rollouts: int = 0
    first_differ: dict[int, tuple[int, int]] = field(default_factory=dict)  # rollout → (first differing position, the replay's choice)
    decided: int = 0
    up: int = 0
    down: int = 0
    soft: list[tuple[str, Evidence]] = field(default_factory=list)
    extremes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(EXTREMES, 0.0))

    def worst(self, name: str, value: float) -> None:
        if math.isfinite(value) and value > self.extremes[name]:
            self.extremes[name] = value

    def replay(self, r: sampling.ReplayResult, rollout: int) -> None:
        differ, over = r.gap_counts(self.edges)
        if self.twins:
            self.rollouts += 1
            if differ:
                assert r.differs is not None  # replay_checks always fills it
                f = int(torch.nonzero(r.differs)[0, 0])
                self.first_differ[rollout] = (f, int(r.tokens[f]))
        self.tokens += int(r.tokens.numel())
        self.differ += differ
        self.gap_over = [a + b for a, b in zip(self.gap_over, over, strict=True)]
        self.impossible += r.impossible
        self.near_ties += r.near_ties
        finite = r.gaps[torch.isfinite(r.gaps)]
        if finite.numel():
            self.worst("gap", float(finite.max()))

    def stats(self) -> ReplayStats:
        return ReplayStats(tokens=self.tokens, differ=self.differ, gap_over=list(self.gap_over), impossible=self.impossible,
                           logprob_over=self.logprob_over, chunks=self.chunks, chunks_over=self.chunks_over, rollouts=self.rollouts,
                           diverged=len(self.first_differ), decided=self.decided, up=self.up, down=self.down)


REWARD_SECONDS_PER_ROLLOUT = 2.0
"""Wall seconds of reward work a submission gets per rollout (:func:`reward_budget_s`). An honest code rollout
scores in ≈ 0.5-0.7 s (6 stdin test cases, 2 CPUs at load 3.8, 7 Dec 2026), a math one in well under a second."""


def reward_budget_s(rollouts: int, limits: RewardLimits) -> float:
    """Wall seconds all reward work of one submission may take before the check stops with ``limit_hit``:
    :data:`REWARD_SECONDS_PER_ROLLOUT` per rollout, at least two completions' whole sandbox time
    (``limits.sandbox.total_wall_time_s``). Each rollout alone is bounded by its sandbox (a code
    completion ≤ ``total_wall_time_s``, 60 s; a math answer ≤ ``math_timeout_s``, 5 s; a disagreement's
    re-runs by as much again, ``validator.rewards.judge_reward``), but a light check runs the rewards of tokens nobody checked, so without
    this a worker could post completions that sleep to just under every limit and cost a validator
    ≈ 60 s per rollout for free: 16 minutes for the default 16 rollouts. With it a submission costs at
    most this budget plus the one rollout running when it runs out."""
    return max(2 * limits.sandbox.total_wall_time_s, REWARD_SECONDS_PER_ROLLOUT * rollouts)




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
        twin_rng: draws, under ``audit.rule = "eprocess-v2"``, whether a full check decodes twins at all
            (``audit.twin_share``) and which diverged rollouts get one when more than
            :data:`protocol.audit.TWINS_PER_SUBMISSION` diverged (default: the OS's randomness, so a
            worker cannot know which will be decided; a seeded one for tests).
        twin_share: overrides ``audit.twin_share`` (the coordinator's calibration decodes the twins of
            every reference submission: its own work, the honest baseline).
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
        twin_rng: random.Random | None = None,
        twin_share: float | None = None,
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
        self.twin_rng = twin_rng or random.SystemRandom()
        self.twin_share = spec.audit.twin_share if twin_share is None else twin_share
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
            tally = self._check(env, timings, full)
        except Rejection as r:
            tally = r.tally
            return CheckResult(False, r.reason, dict(list(r.evidence.items())[:32]), time.perf_counter() - t0, timings,
                               tally.stats() if tally else None, dict(tally.extremes) if tally else {})
        if tally is None:
            return CheckResult(True, OK, {}, time.perf_counter() - t0, timings)
        return CheckResult(True, OK, {}, time.perf_counter() - t0, timings, tally.stats(), dict(tally.extremes))

    # --- the stages --------------------------------------------------------------------------

    def _check(self, env: Envelope[Submission], timings: dict[str, float], full: bool = True) -> _Tally | None:
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
        tally = self._model_checks(sub, seqs, timings) if full else None
        self._rewards(sub, plan, seqs, timings)
        if tally is not None and tally.soft:  # logit-bound-v2: values beyond a bound within the hard factor, after every hard check passed
            what, evidence = tally.soft[0]
            raise Rejection(PRECISION, tally=tally, finding=what, findings=len(tally.soft), **evidence)
        if tally is not None and tally.twins:  # accepted work only: the audit counts nothing of a rejection's
            self._twins(sub, plan, seqs, tally, timings)
        return tally

    def _model_checks(self, sub: Submission, seqs: list[tuple[list[int], list[int], list[float]]], timings: dict[str, float]) -> _Tally:
        """The checks that need the policy: TOPLOC on the batched prefill, termination by the policy,
        sampling replay and log-probs; returns the submission's replay statistics and soft findings."""
        spec = self.spec
        params = sampling.ReplayParams.from_spec(spec, (self.eos_id,))
        tally = _Tally(params.gap_edges, twins=spec.audit.rule == AUDIT_RULE_EPROCESS_V2)
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
        tl = spec.toploc
        verdicts = toploc.verify_proofs_many(  # every rollout's chunks at once
            [row.to(torch.bfloat16) for row in rows], [list(ro.proofs) for ro in sub.rollouts], chunk_size=tl.chunk_size,
            topk=tl.topk, max_mismatches=tl.max_mismatches, max_mant_err_mean=tl.max_mant_err_mean,
            max_mant_err_median=tl.max_mant_err_median,
        )
        hf = params.hard_factor
        for j, results in enumerate(verdicts):
            tally.chunks += len(results)
            for r in results:
                tally.worst("toploc_mismatches", float(r.mismatches))
                tally.worst("toploc_mant_err_mean", r.mant_err_mean)
                tally.worst("toploc_mant_err_median", r.mant_err_median)
            for bad in (r for r in results if not r.ok):
                tally.chunks_over += 1
                evidence: Evidence = {"rollout": j, "chunk": bad.index, "mismatches": bad.mismatches,
                                      "mant_err_mean": _finite(bad.mant_err_mean), "mant_err_median": _finite(bad.mant_err_median)}
                soft = (params.soft and bad.mismatches <= min(tl.topk, hf * tl.max_mismatches)
                        and bad.mant_err_mean <= hf * tl.max_mant_err_mean and bad.mant_err_median <= hf * tl.max_mant_err_median)
                if not soft:
                    raise Rejection("toploc", **evidence, detail=bad.reason[:200])
                tally.soft.append(("toploc", evidence))
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
                self._sampling(params, tally, group, [sub.rollouts[j].seed for j in group], logits, [seqs[j][1] for j in group],
                               [seqs[j][2] for j in group])
        timings["prefill"] += head_s  # the LM head is prefill work, done group by group
        timings["sampling"] = time.perf_counter() - t - head_s
        if params.soft:  # logit-bound-v2 judges the near-tie share over the whole submission
            allowed = math.ceil(params.max_near_tie_fraction * tally.tokens)
            if tally.near_ties > allowed:
                tally.soft.append(("near_ties", {"near_ties": tally.near_ties, "allowed": allowed, "tokens": tally.tokens}))
        if params.replay_rule == REPLAY_RULE_LOGIT_BOUND_V3 and tally.tokens:
            # one token's log-prob tail is soft at any size; shading every log-prob is not (docs/toploc.md §6.4)
            mean = tally.logprob_abs_sum / tally.tokens
            limit = params.hard_factor * tl.logprob_mean_abs
            if not mean <= limit:
                raise Rejection("logprobs", mean_abs_diff=_finite(mean), tokens=tally.tokens, max_submission_mean=limit,
                                detail=f"the submission's mean |log-prob difference| {mean:.4g} nats over {tally.tokens} tokens "
                                       f"exceeds {params.hard_factor:g} × toploc.logprob_mean_abs = {limit:.4g}")
        return tally

    def _rewards(self, sub: Submission, plan: Any, seqs: list[tuple[list[int], list[int], list[float]]], timings: dict[str, float]) -> None:
        spec = self.spec
        g = spec.rl.group_size
        t = time.perf_counter()
        limits = self.reward_limits or RewardLimits()
        budget_s = reward_budget_s(len(sub.rollouts), limits)
        end = rewards._clock() + budget_s
        for j, (ro, (_, completion, _)) in enumerate(zip(sub.rollouts, seqs)):
            if rewards._clock() > end:  # benign: slow programs are no evidence of a cheat, but they get no more of this node's time
                raise Rejection("limit_hit", rollout=j, rollouts=len(sub.rollouts), budget_s=budget_s,
                                detail=f"rewards of {j} of {len(sub.rollouts)} rollouts took the submission's {budget_s:.0f} s")
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

    def _twins(self, sub: Submission, plan: Any, seqs: list[tuple[list[int], list[int], list[float]]], tally: _Tally,
               timings: dict[str, float]) -> None:
        """``eprocess-v2``: decode the float32 twin of up to :data:`~protocol.audit.TWINS_PER_SUBMISSION` diverged
        rollouts (drawn at random; :mod:`validator.twins`), reward each as the claimed completion was, and count
        whose task reward is higher (``docs/toploc.md`` §11.2). A twin whose reward cannot be had (our
        failure, a wall or CPU limit, the environment's fault) is left undecided: never evidence either way;
        one stopped at a memory or output limit scores what the reward gives it then (0)."""
        if not tally.first_differ or (self.twin_share < 1.0 and self.twin_rng.random() >= self.twin_share):
            return  # nothing diverged, or this check is not among the audit.twin_share that decode twins
        t = time.perf_counter()
        spec, g = self.spec, self.spec.rl.group_size
        diverged = sorted(tally.first_differ)
        chosen = sorted(self.twin_rng.sample(diverged, min(TWINS_PER_SUBMISSION, len(diverged))))
        prefixes = [seqs[j][1][:tally.first_differ[j][0]] + [tally.first_differ[j][1]] for j in chosen]
        model = self.model_for_step(sub.policy_step)
        if model is None:  # gone since the model checks: nothing decided
            return
        params = sampling.ReplayParams.from_spec(spec, (self.eos_id,))
        twins = decode_twins(model, [seqs[j][0] for j in chosen], prefixes, [sub.rollouts[j].seed for j in chosen], params,
                             spec.sampling.max_tokens, self.pad_id)  # forward work: the process's threads, as the prefill
        limits = self.reward_limits or RewardLimits()
        for j, twin in zip(chosen, twins, strict=True):
            p = plan[j // g]
            try:
                r = compute_reward(p.task, completion_text(self.tokenizer, twin, self.eos_id), len(twin), p.target_length,
                                   spec.sampling.length_penalty, limits)
            except RewardError:
                continue
            # a memory or output limit is the twin's own (the same program hits it anywhere): it fails. A wall or
            # CPU limit may be this machine's load, an environment fault the environment's: undecided, never
            # evidence. (Skipping every limit let a steerer shelter its ups behind honest programs that loop.)
            if r.env_fault or r.limit_hit not in (None, "memory", "output"):
                continue
            claimed = sub.rollouts[j].task_reward  # checked against the recomputed one by now (_rewards)
            tally.decided += 1
            tally.up += claimed > r.task_reward + self.tol.reward_tol
            tally.down += r.task_reward > claimed + self.tol.reward_tol
        timings["twins"] = time.perf_counter() - t

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

    def _sampling(self, params: sampling.ReplayParams, tally: _Tally, group: list[int], seeds: list[int], logits: torch.Tensor,
                  completions: list[list[int]], logprobs: list[list[float]]) -> None:
        """Termination by the policy, sampling replay and log-probs of consecutive rollouts ``group``
        whose logits are stacked in ``logits`` (``[Σn, V]``, this group's scratch: the replay works in it);
        counts into ``tally``. Under ``logit-bound-v2`` a value beyond its bound but within the hard
        factor is a soft finding (``docs/toploc.md`` §6.3), beyond it the cheat it always was."""
        s, t = self.spec.sampling, self.spec.toploc
        eos_floor = t.eos_min_prob
        slack = params.termination_slack()
        end = 0
        # termination first: a stop where the policy gives EOS little probability is the specific cheat
        for j, completion in zip(group, completions, strict=True):
            end += len(completion)
            term = sampling.termination_check(logits[end - 1], completion, [self.eos_id], s.max_tokens, s.temperature, eos_floor, slack)
            if math.isfinite(term.p_eos):
                tally.worst("eos_shortfall", eos_floor - term.p_eos)
            if term.ok:
                continue
            evidence: Evidence = {"rollout": j, "p_eos": _finite(term.p_eos), "min_p_eos": eos_floor}
            if params.soft and math.isfinite(term.p_eos) and sampling.termination_check(
                    logits[end - 1], completion, [self.eos_id], s.max_tokens, s.temperature, eos_floor, params.termination_slack(hard=True)).ok:
                tally.soft.append(("termination", evidence))
                continue
            raise Rejection("termination", **evidence, detail=term.reason[:200])
        replays = sampling.replay_checks(logits, completions, seeds, params, overwrite=True)
        hf = params.hard_factor
        for j, replay, reported in zip(group, replays, logprobs, strict=True):
            tally.replay(replay, j)
            if not replay.ok:
                raise Rejection("sampling", rollout=j, hard_mismatches=replay.hard_mismatches, near_ties=replay.near_ties,
                                detail=replay.reason[:200])
            if params.soft and replay.out_of_bound:
                tally.soft.append(("sampling", {"rollout": j, "out_of_bound": replay.out_of_bound,
                                                "max_gap": _finite(float(replay.gaps[torch.isfinite(replay.gaps)].max()))}))
            assert replay.logprobs is not None  # replay_checks always fills them: [n] log_softmax(logits / T)[token]
            lp = sampling.logprob_check(reported, replay.logprobs, max_abs=t.logprob_max_abs, mean_abs=t.logprob_mean_abs)
            tally.logprob_over += lp.over
            tally.logprob_abs_sum += lp.mean_abs_err * len(reported) if math.isfinite(lp.mean_abs_err) else math.inf
            tally.worst("logprob_abs", lp.max_abs_err)
            tally.worst("logprob_mean_abs", lp.mean_abs_err)
            if lp.ok:
                continue
            evidence = {"rollout": j, "position": lp.position, "max_abs_diff": _finite(lp.max_abs_err), "mean_abs_diff": _finite(lp.mean_abs_err)}
            within = lp.max_abs_err <= hf * t.logprob_max_abs and lp.mean_abs_err <= hf * t.logprob_mean_abs
            tail = params.replay_rule == REPLAY_RULE_LOGIT_BOUND_V3 and math.isfinite(lp.max_abs_err)  # non-finite: no honest tail
            if params.soft and (within or tail):
                tally.soft.append(("logprobs", evidence))
                continue
            raise Rejection("logprobs", **evidence, detail=lp.reason[:200])


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
