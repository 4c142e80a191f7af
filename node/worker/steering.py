"""The steering adversary (``--adversary steer``): honest sampling, except where the right answer's
next token passes the validator's replay anyway (``docs/validator.md`` § Chaos, issue 33).

A worker whose arithmetic differs from the validator's (bf16 against float32) must be allowed some
tokens the validator's replay would not have chosen: the run's replay rule (run spec
``toploc.replay_rule``; ``docs/toploc.md`` §6) accepts every token within its tolerance (ε under
``eps-v1``, the logit bound δ under ``logit-bound-v1``), at most ``⌈max_near_tie_fraction · n⌉``
of them per completion. This worker spends that allowance on purpose. It decodes honestly in its
compute dtype and, in lock step, runs the float32 policy the validator prefills; at every position
of a math task where its completion so far equals a prefix of the ground-truth answer's tokens
(then EOS), the answer's next token differs from its honest token, and the validator's own check
(:func:`judge_tokens`: :func:`protocol.sampling.replay_checks` on that one token, with the run
spec's tolerances; for EOS also :func:`protocol.sampling.termination_check`) would accept it
without exceeding the near-tie cap, it has a *chance*, and takes it with probability ``rate`` (a
seeded RNG). Everything else is honest: the TOPLOC proofs and log-probs come from a prefill of the
emitted tokens in its compute dtype, the rewards are computed for what it emitted.

The near-tie cap is judged on the length so far: the emitted tokens that differ from the
validator's choice (steered ones and honest near ties alike, as the steerer's own replay sees them)
are kept ``≤ ⌈fraction · (i + 1)⌉`` at every completion position ``i``, and the completion ends at
length ``n ≥ i + 1``, so the validator's ``⌈fraction · n⌉`` holds. A deviation is made only within
that budget; where an honest token would be a near tie beyond it (bf16 noise after a steered
token), the steerer emits the replay's own choice instead (a *repair*, counted), so it is never
rejected for its near ties.

:func:`steer_generate` is the core (``benchmarks/steering.py`` calls it per steering rate);
:class:`SteeringEngine` carries the float32 policy, the rate and the RNG for the worker role.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.engine.base import Engine, Generation, SamplingParams
from node.engine.hf import TransformersEngine, seeds_tensor
from node.worker.rollouts import BuildStats, prove_and_score
from protocol import sampling
from protocol.inference import completion_rows, forward, pad_left
from protocol.messages import Rollout
from protocol.models import copy_weights, load_model
from protocol.rewards import RewardLimits
from protocol.rollout import PlannedTask
from protocol.runspec import RunSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenJudgement:
    """What the validator's checks say about one claimed token at one completion position.

    Attributes:
        admissible: the replay finds no hard mismatch there (gap within the rule's tolerance), and
            for EOS the stop passes the termination floor: a submission holding it is not rejected
            for it alone.
        differs: the replay's own choice is another token (an admissible one is a near tie).
        gap: the replay's gap of the token (``ReplayResult.gaps``: probability units under
            ``eps-v1``, nats under ``logit-bound-v1``; 0 where it is the replay's choice).
        replay_token: the replay's own choice at this position.
    """

    admissible: bool
    differs: bool
    gap: float
    replay_token: int


def judge_tokens(spec: RunSpec, logits: torch.Tensor, tokens: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                 eos_id: int) -> list[TokenJudgement]:
    """The validator's verdict on each claimed token alone, exactly as ``validator/pipeline.py`` calls
    the checks with the run spec's rules and tolerances (``spec.sampling``, ``spec.toploc``), so the
    steerer adapts to whatever replay rule a spec names. The one place the steerer judges a token.

    Args:
        spec: the run spec.
        logits: ``[R, V]`` float32 the validator's logits at the rows that produce the tokens
            (the float32 policy's; left unchanged).
        tokens: ``R`` claimed token IDs.
        seeds: ``R`` sequence seeds of their completions.
        positions: ``R`` completion positions of the tokens.
        eos_id: the EOS token.

    Returns:
        One :class:`TokenJudgement` per token.

    Raises:
        ValueError: mismatched lengths (as :func:`protocol.sampling.replay_checks`).
    """
    s, t = spec.sampling, spec.toploc
    params = sampling.ReplayParams.from_spec(spec, (eos_id,))
    results = sampling.replay_checks(logits, [[int(x)] for x in tokens], [int(x) for x in seeds], params, [int(x) for x in positions])
    slack = params.termination_slack()
    out = []
    for row, (token, r) in enumerate(zip(tokens, results, strict=True)):
        ok = r.hard_mismatches == 0
        if ok and int(token) == eos_id:  # the stop itself: P(EOS) at this row against the floor
            ok = sampling.termination_check(logits[row], [eos_id], [eos_id], s.max_tokens, s.temperature, t.eos_min_prob, slack).ok
        out.append(TokenJudgement(admissible=ok, differs=int(r.tokens[0]) != int(token), gap=float(r.gaps[0]), replay_token=int(r.tokens[0])))
    return out


def answer_tokens(plan_task: PlannedTask, tokenizer: Any) -> list[int] | None:
    """The tokens a steerer aims for: the ground truth's text tokens, then EOS; ``None`` for a task
    without a ground-truth answer (code)."""
    if plan_task.task.task_type != "verifiable_math":
        return None
    return [int(x) for x in tokenizer.encode(plan_task.task.ground_truth, add_special_tokens=False)] + [int(tokenizer.eos_token_id)]


@dataclass
class SteeredRollouts:
    """What :func:`steer_generate` made: the rollouts and, per rollout, what the steering did.

    Attributes:
        rollouts: ``len(plan) × group_size`` rollouts, task-major, signed-ready (honest proofs,
            log-probs and rewards of the emitted tokens).
        chances: per rollout, positions where the answer's next token differed from the honest one
            and the validator's check would have accepted it within the near-tie cap.
        taken: per rollout, chances taken (the answer's token emitted instead of the honest one).
        near_ties: per rollout, emitted tokens the validator's replay would not have chosen but
            accepts (steered and honest ones), as the steerer's float32 replay sees them.
        hard: per rollout, emitted tokens the replay would refuse (honest noise beyond the
            tolerance, or an EOS under the termination floor): such a rollout will be rejected.
        repaired: per rollout, honest near ties replaced by the replay's choice to stay within the cap.
        tokens: per rollout, completion length.
    """

    rollouts: list[Rollout]
    chances: list[int]
    taken: list[int]
    near_ties: list[int]
    hard: list[int]
    repaired: list[int]
    tokens: list[int]


@torch.no_grad()
def steer_generate(
    spec: RunSpec,
    policy_fp32: torch.nn.Module,
    worker_model: torch.nn.Module,
    tokenizer: Any,
    plan: Sequence[PlannedTask],
    rate: float = 1.0,
    rng: random.Random | None = None,
    *,
    head_fp32: torch.Tensor | None = None,
    reward_limits: RewardLimits | None = None,
    stats: BuildStats | None = None,
) -> SteeredRollouts:
    """Generate the planned rollouts, steering toward the right answer wherever the replay allows.

    Both models decode in lock step with their own KV caches over the left-padded batch of every
    planned sample (``len(plan) × group_size`` rows, ≤ ``spec.sampling.max_tokens`` steps). Per
    step: the worker's logits (its compute dtype, sampled as float32) give the honest tokens by
    the run's rule; the float32 policy's logits are what the validator will recompute; one
    :func:`judge_tokens` call judges the honest tokens of the unfinished rows and the answer's
    tokens at the chances; the emitted token is the answer's where a chance is taken
    (``rng.random() < rate``), the honest one elsewhere (the replay's own where an honest near tie
    would exceed the near-tie budget: a repair).

    Args:
        spec: the run spec (sampling rule and parameters, replay rule and tolerances, max tokens).
        policy_fp32: the policy in float32, as the validator loads it (``protocol.models.load_model``).
        worker_model: the policy in the worker's compute dtype (bf16 or float32), same device.
        tokenizer: the policy's tokenizer (EOS, pad, the answers' tokens).
        plan: the planned tasks (``protocol.rollout.plan_submission``).
        rate: steering rate in [0, 1]: the share of chances taken (1.0: all; 0.0: an honest worker
            that reports its chances).
        rng: decides which chances are taken (default ``random.Random(0)``).
        head_fp32: ``[V, H]`` float32 LM head: the worker's logits are its rows in float32 times
            this ("fp32 logits", ``node.engine.hf``); ``None``: ``worker_model``'s own head.
        reward_limits: sandbox limits for code rewards.
        stats: filled with timings, tokens and task rewards if given.

    Returns:
        :class:`SteeredRollouts`.

    Raises:
        ValueError: ``rate`` outside [0, 1].
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"steering rate {rate} is not in [0, 1]")
    rng = rng if rng is not None else random.Random(0)
    stats = stats if stats is not None else BuildStats()
    s, frac = spec.sampling, spec.toploc.max_near_tie_fraction
    per_submission = sampling.ReplayParams.from_spec(spec, (int(tokenizer.eos_token_id),)).soft
    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [list(p.prompt_ids) for p in plan for _ in p.seeds]
    seeds = [int(x) for p in plan for x in p.seeds]
    answers = [answer_tokens(p, tokenizer) for p in plan for _ in p.seeds]
    b_n, n_max = len(prompts), s.max_tokens
    device = next(worker_model.parameters()).device
    t0 = time.perf_counter()

    def worker_logits(o: Any) -> torch.Tensor:  # the last position's [B, V] float32 logits of a forward
        return o.logits[:, -1] if head_fp32 is None else torch.nn.functional.linear(o.hidden[:, -1].float(), head_fp32)

    ids, mask, pos = (x.to(device) for x in pad_left(prompts, pad))
    last = torch.tensor([ids.shape[1] - 1], device=device)
    w_out = forward(worker_model, ids, mask, pos, use_cache=True, logits_positions=last, with_logits=head_fp32 is None)
    v_out = forward(policy_fp32, ids, mask, pos, use_cache=True, logits_positions=last)
    w_cache, v_cache = w_out.cache, v_out.cache
    w_logits = worker_logits(w_out)  # [B, V]
    v_logits = v_out.logits[:, -1]  # [B, V] float32
    seed_t = seeds_tensor(seeds, str(device))  # [B] int64
    next_pos = pos[:, -1:] + 1  # [B, 1]
    out: list[list[int]] = [[] for _ in range(b_n)]
    done = [False] * b_n
    steering = [a is not None for a in answers]
    chances, taken, near, hard, repaired = [0] * b_n, [0] * b_n, [0] * b_n, [0] * b_n, [0] * b_n
    for i in range(n_max):
        honest, _ = sampling.sample(w_logits, seed_t, torch.full((b_n,), i, dtype=torch.int64, device=device), s.temperature, s.top_p,
                                    (eos,), spec.toploc.eos_min_prob, s.rule)
        h = honest.tolist()
        active = [b for b in range(b_n) if not done[b]]
        cands = [b for b in active if steering[b] and i < len(answers[b] or ()) and answers[b][i] != h[b]]  # type: ignore[index]
        rows = active + cands
        claimed = [h[b] for b in active] + [answers[b][i] for b in cands]  # type: ignore[index]
        judged = judge_tokens(spec, v_logits[torch.tensor(rows, device=device)], claimed, [seeds[b] for b in rows], [i] * len(rows), eos)
        on_honest = dict(zip(active, judged[: len(active)], strict=True))
        on_answer = dict(zip(cands, judged[len(active):], strict=True))
        emitted = list(h)
        allowed = math.ceil(frac * (i + 1))  # per completion (logit-bound-v1, eps-v1)
        # logit-bound-v2 caps near ties over the whole submission: one shared budget, this step's honest ones counted
        room = (math.ceil(frac * (sum(len(x) for x in out) + len(active))) - sum(near)
                - sum(int(on_honest[b].admissible and on_honest[b].differs) for b in active))
        for b in cands:
            j = on_answer[b]
            # steering replaces b's honest token: under a shared budget its own near tie (if any) is freed
            extra = int(j.differs) - (int(on_honest[b].admissible and on_honest[b].differs) if per_submission else 0)
            fits = room - extra >= 0 if per_submission else near[b] + extra <= allowed
            if j.admissible and fits:
                chances[b] += 1
                if rng.random() < rate:
                    taken[b] += 1
                    emitted[b] = answers[b][i]  # type: ignore[index]
                    if per_submission:
                        room -= extra
        for b in active:
            j = on_answer[b] if emitted[b] != h[b] else on_honest[b]
            if j is on_honest[b] and j.differs and not per_submission and near[b] + 1 > allowed:  # an honest near tie over the budget
                emitted[b], repaired[b] = j.replay_token, repaired[b] + 1
                j = TokenJudgement(admissible=True, differs=False, gap=0.0, replay_token=j.replay_token)
            near[b] += int(j.admissible and j.differs)
            hard[b] += int(not j.admissible)
            answer = answers[b]
            steering[b] = steering[b] and answer is not None and i < len(answer) and emitted[b] == answer[i]
            out[b].append(emitted[b])
            done[b] = emitted[b] == eos
        if all(done) or i + 1 == n_max:
            break
        tok = torch.tensor([pad if d else e for d, e in zip(done, emitted, strict=True)], dtype=torch.int64, device=device)[:, None]
        mask = torch.cat([mask, torch.ones((b_n, 1), dtype=mask.dtype, device=device)], dim=1)
        w_out = forward(worker_model, tok, mask, next_pos, w_cache, use_cache=True, with_logits=head_fp32 is None)
        v_out = forward(policy_fp32, tok, mask, next_pos, v_cache, use_cache=True)
        w_cache, v_cache = w_out.cache, v_out.cache
        w_logits = worker_logits(w_out)
        v_logits = v_out.logits[:, -1]
        next_pos = next_pos + 1
    gens = _prefill_generations(worker_model, head_fp32, prompts, out, pad, eos, s.temperature)
    stats.generate_s += time.perf_counter() - t0
    rollouts = prove_and_score(spec, tokenizer, plan, gens, reward_limits, stats)
    return SteeredRollouts(rollouts, chances, taken, near, hard, repaired, [len(x) for x in out])


def _prefill_generations(model: torch.nn.Module, head_fp32: torch.Tensor | None, prompts: list[list[int]], completions: list[list[int]],
                         pad: int, eos: int, temperature: float) -> list[Generation]:
    """Honest rows and log-probs of chosen completions: one prefill in the model's dtype (as ``fake-eos`` does)."""
    gens = []
    for ids, rows in zip(completions, completion_rows(model, prompts, completions, pad), strict=True):
        head_logits = model.lm_head(rows).float() if head_fp32 is None else torch.nn.functional.linear(rows.float(), head_fp32)  # [n, V]
        t = torch.tensor(ids, dtype=torch.int64, device=rows.device)
        lp = torch.log_softmax(head_logits / temperature, dim=-1).gather(-1, t[:, None])[:, 0]  # [n]
        gens.append(Generation(completion_ids=t.cpu(), logprobs=lp.float().cpu(), hidden=rows.to(torch.bfloat16).cpu(),
                               finish="eos" if ids[-1] == eos else "length"))
    return gens


@dataclass
class SteeringTotals:
    """A steering worker's running counts (its ``/status`` ``steering``)."""

    rollouts: int = 0
    tokens: int = 0
    chances: int = 0
    taken: int = 0
    rollouts_steered: int = 0
    hard: int = 0
    repaired: int = 0

    def add(self, r: SteeredRollouts) -> None:
        self.rollouts += len(r.rollouts)
        self.tokens += sum(r.tokens)
        self.chances += sum(r.chances)
        self.taken += sum(r.taken)
        self.rollouts_steered += sum(1 for x in r.taken if x)
        self.hard += sum(r.hard)
        self.repaired += sum(r.repaired)

    def to_json(self) -> dict[str, int]:
        return {"rollouts": self.rollouts, "tokens": self.tokens, "chances": self.chances, "taken": self.taken,
                "rollouts_steered": self.rollouts_steered, "hard": self.hard, "repaired": self.repaired}


class SteeringEngine(Engine):
    """The steering adversary's engine: the worker's own engine (its compute dtype, used for
    :meth:`generate`), a float32 copy of the policy (what validators prefill), the steering rate and
    its RNG, and running :class:`SteeringTotals`.

    Args:
        worker: the worker's transformers engine (float32 or bfloat16).
        policy: the float32 policy; ``None``: the worker's own model (a float32 worker only).
        rate: steering rate in [0, 1].
        rng: decides which chances are taken (default ``random.Random(0)``).

    Raises:
        ValueError: ``policy`` missing for a non-float32 worker, or ``rate`` outside [0, 1].
    """

    def __init__(self, worker: TransformersEngine, policy: torch.nn.Module | None = None, rate: float = 1.0,
                 rng: random.Random | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"steering rate {rate} is not in [0, 1]")
        if policy is None:
            if worker.compute_dtype != torch.float32:
                raise ValueError("a steering worker computing in another dtype needs the float32 policy (SteeringEngine.from_dir)")
            policy = worker.model
        self.worker = worker
        self.policy = policy.eval()
        self.rate = rate
        self.rng = rng if rng is not None else random.Random(0)
        self.totals = SteeringTotals()

    @classmethod
    def from_dir(cls, worker: TransformersEngine, model_dir: Path, rate: float = 1.0, rng: random.Random | None = None) -> SteeringEngine:
        """Wrap ``worker`` with a float32 policy loaded from ``model_dir`` (the worker's own model if it is float32)."""
        policy = None if worker.compute_dtype == torch.float32 else load_model(Path(model_dir), device=worker.device)
        return cls(worker, policy, rate, rng)

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    def load_weights(self, model_dir: Path) -> None:
        """Swap in ``model_dir`` on the worker and on the float32 policy (once when they are one model)."""
        self.worker.load_weights(model_dir)
        if self.policy is not self.worker.model:
            copy_weights(self.policy, Path(model_dir))
            self.policy.eval()

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        """Honest generation (the worker's engine): what it does where it does not steer."""
        return self.worker.generate(prompts, seeds, params)

    def steer(self, spec: RunSpec, tokenizer: Any, plan: Sequence[PlannedTask], reward_limits: RewardLimits | None = None,
              stats: BuildStats | None = None) -> SteeredRollouts:
        """:func:`steer_generate` with this engine's models, rate and RNG; adds to :attr:`totals`."""
        result = steer_generate(spec, self.policy, self.worker.model, tokenizer, plan, self.rate, self.rng, head_fp32=self.worker.head_fp32,
                                reward_limits=reward_limits, stats=stats)
        self.totals.add(result)
        logger.info("steered %d of %d chances over %d rollouts (%d tokens); %d rollouts steered; run so far: %d of %d chances",
                    sum(result.taken), sum(result.chances), len(result.rollouts), sum(result.tokens),
                    sum(1 for x in result.taken if x), self.totals.taken, self.totals.chances)
        return result
