"""Can this run learn at all? A short probe of the base policy before any worker joins.

GRPO's advantage is ``(r − mean) / (std + ε)`` per group (arXiv 2402.03300 §4.1): a group whose
rewards are all equal carries no gradient, and the trainer drops it. A base that never (or
always) solves the run's tasks, with no length penalty to tell completions apart, gives only
such groups — the coordinator would wait for a batch that can never fill. The probe samples a few
training tasks with the run's sampling rule, a whole group each, scores them exactly as workers
and validators do, and says what to change when no group has a reward spread.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from node.engine.base import Engine
from node.worker.rollouts import sampling_params
from protocol.rewards import RewardLimits, compute_rewards
from protocol.rollout import completion_text, encode_prompt
from protocol.runspec import RunSpec
from protocol.tasks import Task

logger = logging.getLogger(__name__)

PROBE_TASKS = 4
"""Training tasks the coordinator probes at start (one whole group each)."""


@dataclass(frozen=True)
class SignalProbe:
    """What the probe saw.

    Attributes:
        groups: groups sampled (one per probed task).
        groups_with_spread: groups whose rewards were not all equal (the ones GRPO learns from).
        pass_rate: fraction of completions with task reward 1.
        capped_fraction: fraction of completions that hit ``sampling.max_tokens``.
        mean_tokens: mean completion length, tokens.
        warning: what to change when no group had a spread; ``None`` when the run can learn.
    """

    groups: int
    groups_with_spread: int
    pass_rate: float
    capped_fraction: float
    mean_tokens: float
    warning: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


LONG_ANSWER_TOKENS = 1024
"""A completion limit this long already fits a reasoned answer: when every completion still hits it,
the model does not end its answers, and raising the limit will not help."""
EASIER = {"math_train": "gsm8k_train", "math500": "gsm8k_train", "humaneval": "mbpp"}
"""A public set that is easier than another (grade-school math over competition math, basic Python over HumanEval)."""
HARDER = {"embedded": "gsm8k_train", "gsm8k_train": "math_train", "gsm8k": "math_train", "mbpp": "humaneval"}
"""...and one that is harder."""
NEW_RUN = "each is a change of the signed spec: write a new one with intellect-node spec init (a new run ID) and start a new run"


def no_signal_advice(spec: RunSpec, pass_rate: float, capped_fraction: float) -> str:
    """What to change in the run spec when groups have no reward spread (one line).

    Never names what the run already uses as a remedy (its task set, its limit); says that every
    remedy is a new spec and a new run (the spec is signed; its hash is the run ID).
    """
    hints = []
    tasks, max_tokens = spec.data.tasks, spec.sampling.max_tokens
    capped = capped_fraction >= 0.99
    if capped and max_tokens < LONG_ANSWER_TOKENS:
        hints.append(f"every completion hit max_tokens {max_tokens}: allow longer answers (spec init --max-tokens {min(4 * max_tokens, LONG_ANSWER_TOKENS)}) "
                     "if the model's answers are longer, but a model that never samples EOS needs what the next hint says")
    if capped:
        hints.append(f"the model does not end its answers (no EOS within {max_tokens} tokens), so every completion has the same length and "
                     "the same reward, and a length penalty cannot tell them apart: use an instruction-tuned model that ends its answers "
                     "(e.g. a Qwen2.5 Instruct), or warm-start (fine-tune) this base on answers that end with EOS")
    if spec.env.name:  # the run's own environment: its configuration is the remedy
        tasks = spec.env.name
        own = "(its env.args, e.g. spec init --env-arg; docs/tasks.md § Your own environment)"
    else:
        own = "(your own task file, docs/tasks.md)"
    if pass_rate == 0.0:
        easier = EASIER.get(tasks)
        hints.append(f"the base solves none of these tasks: a stronger base, or easier tasks than {tasks!r} "
                     + (f"(data.tasks = {easier!r})" if easier else own))
    elif pass_rate == 1.0:
        harder = HARDER.get(tasks)
        hints.append(f"the base solves every task: harder tasks than {tasks!r} " + (f"(data.tasks = {harder!r})" if harder else own))
    if spec.sampling.length_penalty == 0.0 and not capped:
        hints.append("or add a length reward (spec init --length-penalty 0.0003 --target-length N, INTELLECT-2) so completions of "
                     "different lengths score differently")
    elif spec.sampling.length_penalty != 0.0 and not spec.sampling.target_lengths:
        hints.append("the length penalty needs targets: spec init --target-length N")
    if not hints:
        hints.append("sample more diverse completions (spec init --temperature, higher)")
    return "; ".join(hints) + f"; {NEW_RUN}"


def probe_learning_signal(
    spec: RunSpec, engine: Engine, tokenizer: Any, tasks: Sequence[Task], *, n_tasks: int = PROBE_TASKS,
    reward_limits: RewardLimits | None = None,
) -> SignalProbe:
    """Sample ``n_tasks`` evenly spaced training tasks, ``rl.group_size`` completions each, and count
    groups whose rewards differ.

    Target lengths cycle through ``sampling.target_lengths`` (none when empty); seeds are fixed
    (``SHA-256("probe" || run seed || task || sample)``). Rewards are ``protocol.rewards.compute_rewards``
    with the run's length penalty, as workers compute them.

    Returns:
        A :class:`SignalProbe`; ``warning`` is set when no group had a reward spread.
    """
    n = min(n_tasks, len(tasks))
    if n == 0:
        return SignalProbe(0, 0, 0.0, 0.0, 0.0, None)
    picked = [tasks[i * len(tasks) // n] for i in range(n)]
    targets: list[int | None] = [*spec.sampling.target_lengths] or [None]
    prompts, seeds, owners = [], [], []
    for gi, t in enumerate(picked):
        target = targets[gi % len(targets)]
        ids = encode_prompt(tokenizer, t, target)
        for s in range(spec.rl.group_size):
            prompts.append(ids)
            h = hashlib.sha256(f"probe|{spec.run.seed}|{t.problem_id}|{s}".encode()).digest()
            seeds.append(int.from_bytes(h[:8], "big") >> 1)
            owners.append((gi, t, target))
    eos = int(tokenizer.eos_token_id)
    gens = engine.generate(prompts, seeds, sampling_params(spec, eos))
    rewards: dict[int, list[float]] = {}
    passed = capped = tokens = 0
    ids_all = [g.completion_ids.tolist() for g in gens]
    scored = compute_rewards([(t, completion_text(tokenizer, ids, eos), len(ids), target) for ids, (_, t, target) in zip(ids_all, owners)],
                             spec.sampling.length_penalty, reward_limits)
    for ids, r, (gi, _, _) in zip(ids_all, scored, owners):
        rewards.setdefault(gi, []).append(r.reward)
        passed += r.task_reward == 1.0
        capped += len(ids) >= spec.sampling.max_tokens
        tokens += len(ids)
    spread = sum(1 for rs in rewards.values() if max(rs) != min(rs))
    pass_rate, capped_fraction = passed / len(gens), capped / len(gens)
    warning = None
    if spread == 0:
        warning = (f"no learning signal: in {n} probe groups of {spec.rl.group_size} on the base model every group's rewards "
                   f"were equal (pass rate {pass_rate:.2f}, {capped_fraction:.0%} of completions at max_tokens, length penalty "
                   f"{spec.sampling.length_penalty:g}), so GRPO gets no gradient from such groups and batches fill slowly or never; "
                   f"{no_signal_advice(spec, pass_rate, capped_fraction)}")
    return SignalProbe(n, spread, round(pass_rate, 4), round(capped_fraction, 4), round(tokens / len(gens), 2), warning)
