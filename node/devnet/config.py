"""The run spec of a devnet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.identity import NodeKey, PeerId
from protocol.runspec import (
    CALIBRATION_BATCHES_NEW_RUNS,
    ENV_TASKS,
    AuditSpec,
    DataSpec,
    EnvSpec,
    ModelSpec,
    NetworkSpec,
    RLSpec,
    RunInfo,
    RunSpec,
    SamplingSpec,
    ShardcastSpec,
    ToplocSpec,
)

EMBEDDED_SAMPLING = SamplingSpec(max_tokens=4, temperature=1.5, top_p=1.0)
"""Answers are 1–3 digits and EOS. Temperature 1.5 keeps the warm-started policy exploring (about a
quarter of its held-out samples are right, greedy decoding 58 %), so GRPO has mixed groups to
learn from and the held-out pass rate has room to rise (``docs/devnet.md``)."""

EMBEDDED_RL = RLSpec(
    async_level=2, group_size=16, batch_groups=16, learning_rate=1e-3, warmup_steps=0, old_logprobs="behavior",
    micro_batch_tokens=4096,
)
"""Tuned for the 0.3 M-parameter embedded model on 2 CPU cores: 256 rollouts per step (cheap at
≤ 4 tokens each), a large learning rate, and behavior log-probs as the ratio denominator so the
stale batches of an async run are importance-corrected (uncorrected, level 4 unlearned; level 2
and this correction are chosen from ``benchmarks/async_levels.py``, ``docs/trainer.md`` §9)."""

ENV_TRAIN_SIZE = 2000
ENV_HELDOUT_SIZE = 100
"""Tasks a devnet's environment generates: 2,000 training, 100 held out (before dropping those a
training task shares a prompt with)."""
ENV_MAX_TOKENS_RANGE = (4, 64)
"""A devnet's environment samples up to its longest reference completion + EOS tokens, within this range."""


EMBEDDED_ENV_PRESETS: dict[str, dict[str, Any]] = {
    "reasoning_gym:basic_arithmetic": {
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"], "allow_parentheses": False,
                             "allow_negation": False},
        "template": "{metadata[expression]}=",
        "answer": "text",
    },
}
"""``env.args`` the devnet gives a reasoning-gym dataset on the embedded model when no ``--env-arg``
is passed: at its default difficulty (up to 6 terms of up to 4 digits with + - * /, a prose prompt) the 0.3 M-parameter
model solves none, so every group has equal rewards and no step can be trained (measured 7 Dec 2026:
step 0 waited with 1 of 16 usable groups after 219 all-zero ones). The preset is the embedded task's
shape: sums of two numbers of up to two digits (reasoning-gym draws up to 10**digits: 100 occurs), ``a + b=``, answered with the number (with one
digit, 121 prompts in all: a 2,000-task training set holds every one, and no held-out task is left)."""


def embedded_env_args(name: str) -> dict[str, Any] | None:
    """The devnet's :data:`EMBEDDED_ENV_PRESETS` entry for ``name`` (a deep copy), or ``None``."""
    import copy

    preset = EMBEDDED_ENV_PRESETS.get(name)
    return copy.deepcopy(preset) if preset is not None else None


def env_sampling(max_tokens: int) -> SamplingSpec:
    """Sampling of a devnet's environment on the embedded model: :data:`EMBEDDED_SAMPLING` (temperature
    1.5, no length prompt) with room for the longest reference completion and EOS."""
    lo, hi = ENV_MAX_TOKENS_RANGE
    return EMBEDDED_SAMPLING.model_copy(update={"max_tokens": min(hi, max(lo, max_tokens))})


def devnet_env(name: str, args: dict[str, Any], *, seed: int = 0) -> tuple[EnvSpec, str, int]:
    """Open a devnet's environment once in this process and pin it.

    Returns:
        ``(env, tasks_hash, tokens)``: the ``[env]`` section (with its ``hash``), the hash of its
        training tasks (``data.tasks_hash``), and the longest reference completion in characters
        plus one for EOS (tokens, at the embedded model's one token per character).

    Raises:
        protocol.envs.EnvError: as :func:`protocol.envs.open_environment` (a missing extra: the line names it).
        protocol.rewards.RewardError: no bubblewrap sandbox here.
    """
    from protocol.envs import open_environment, row_answer
    from protocol.tasks import dataset_hash

    env = open_environment(name, args=args, seed=seed, train_size=ENV_TRAIN_SIZE, heldout_size=ENV_HELDOUT_SIZE)
    try:
        tasks = env.tasks
        longest = max((len(a) for t in tasks.train if (a := row_answer(t)) is not None), default=ENV_MAX_TOKENS_RANGE[1] - 1)
        section = EnvSpec(name=name, args=args, hash=env.hash, seed=seed, train_size=ENV_TRAIN_SIZE, heldout_size=ENV_HELDOUT_SIZE)
        return section, dataset_hash(tasks.train), longest + 1
    finally:
        env.close()


REAL_TASKS_SAMPLING = SamplingSpec(max_tokens=32, temperature=1.0, target_lengths=[8, 16, 32], length_penalty=0.003)
REAL_TASKS_RL = RLSpec(async_level=2, group_size=4, batch_groups=4, learning_rate=1e-4, warmup_steps=0, old_logprobs="behavior",
                       micro_batch_tokens=8192)
"""Real task sets: the tiny model rarely solves them, so the INTELLECT-2 length penalty (toward a
drawn target length) is what varies within groups and keeps every stage busy."""

PROFILE_RL = RLSpec(async_level=2, group_size=4, batch_groups=1, learning_rate=3e-7, warmup_steps=0, old_logprobs="behavior",
                    micro_batch_tokens=512)
"""A real-shape profile (``--profile``, ``node/devnet/profile.py``): one group of 4 per step (one
task per submission), INTELLECT-2's learning rate (3e-7) so the published bf16 step deltas are
the size a real run's are, and short packed rows (≤ 512 tokens: 2 rollouts) because the
trainer's logits over a 151,936-token vocabulary cost 0.6 MB per token in float32."""
PROFILE_MAX_NEAR_TIE_FRACTION = 1.0
"""``toploc.max_near_tie_fraction`` of a profile run: every near tie allowed. A profile's weights are
random, so its next-token distributions are near-uniform over 151,936 ids (≈ 6.6e-6 each): float32
noise between a worker's decode and a validator's prefill moves the sampled id within ``replay_eps``
often, and ``eps-v1`` judges near ties per completion (1 allowed in ≤ 10 tokens). An honest worker
was banned so (``sampling: 2 near-tie mismatches > 1 allowed``, 1 of 9 one-layer profile runs,
7 Dec 2026). A profile measures time, bytes and memory, not how tight verification is; hard
mismatches (beyond ε) are still cheats. ``eps-v1`` keeps its meaning for every other spec."""
PROFILE_PIECE_BYTES = 4 * 1024 * 1024
"""Shardcast piece size at a profile: a 1 GB checkpoint in ≈ 240 pieces (the devnet's 256 KiB
would be ≈ 3,800 requests per full fetch)."""


WORKER_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
"""``devnet --worker-dtype`` names → the workers' compute dtype (``join --dtype``)."""

DEVNET_AUDIT = AuditSpec(rule="eprocess-v2", calibration_submissions=4, min_calibration_tokens=10_000,
                         calibration_batches=CALIBRATION_BATCHES_NEW_RUNS)
"""The per-worker audit of a devnet whose workers compute in bf16 (``docs/toploc.md`` §11): the rate test and
the twin test (§11.2); the coordinator checks 4 honest reference submissions per published step (≈ 760 tokens
of the embedded task), round-robin over decode batch sizes 1, 8 and 64 (honest statistics depend on the batch size;
each event's bound is the largest of theirs, ``docs/toploc.md`` §11.1), and flags no one before its baseline holds
10,000 replayed tokens in each of them (a burst of reference submissions at step 0, which goes on until each also
holds 64 decisive twins or has made 256: measured 768 submissions in 66 s on a 2-core CPU at load 2, 7 Dec 2026,
against 256 in 9 s calibrating batch 64 alone; ≈ 24,600 tokens and 34–46 decisive twins per batch size)."""


def precision_toploc(worker_dtype: str, measured: ToplocSpec | None = None) -> ToplocSpec:
    """The ``[toploc]`` section fit for workers computing in ``worker_dtype`` against float32 validators:
    the defaults (``eps-v1``) for float32; for bfloat16 the ``logit-bound-v3`` section measured on the
    run's base (:func:`node.precision.cached_measurement` → :meth:`~node.precision.PrecisionMeasurement.toploc`).
    The one place a devnet chooses its verification tolerances by precision.

    Args:
        worker_dtype: a key of :data:`WORKER_DTYPES` (``fp32``, ``float32``, ``bf16``, ``bfloat16``).
        measured: the measured section (required for bfloat16).

    Raises:
        ValueError: an unknown dtype name, or bfloat16 without a measurement.
    """
    dtype = WORKER_DTYPES.get(worker_dtype)
    if dtype is None:
        raise ValueError(f"unknown worker dtype {worker_dtype!r}; choose one of {', '.join(WORKER_DTYPES)}")
    if dtype == "float32":
        return ToplocSpec()
    if measured is None or measured.worker_dtype != dtype:
        raise ValueError("bfloat16 workers need tolerances measured on the run's base (node.precision.cached_measurement)")
    return measured


def devnet_rl(*, embedded: bool, async_level: int | None = None, rl_overrides: dict[str, Any] | None = None,
              profile: bool = False) -> RLSpec:
    """The ``[rl]`` section of a devnet: :data:`EMBEDDED_RL`, :data:`PROFILE_RL` (``profile``) or
    :data:`REAL_TASKS_RL`, with the async level and the ``rl_overrides`` fields replaced and the
    result checked by ``RLSpec``.

    Raises:
        pydantic.ValidationError: an override names no ``[rl]`` field, or the section is invalid.
    """
    rl = EMBEDDED_RL if embedded else PROFILE_RL if profile else REAL_TASKS_RL
    update = dict(rl_overrides or {})
    if async_level is not None:
        update["async_level"] = async_level
    return RLSpec.model_validate({**rl.model_dump(), **update}) if update else rl


def devnet_spec(
    coordinator: NodeKey,
    validators: list[PeerId],
    *,
    tasks: str,
    http_url: str,
    bootstrap: str,
    seed: int,
    heartbeat_interval_s: float = 1.0,
    async_level: int | None = None,
    model: Path | None = None,
    rl_overrides: dict[str, Any] | None = None,
    profile: bool = False,
    deltas: bool = True,
    env: EnvSpec | None = None,
    tasks_hash: str = "",
    env_max_tokens: int = ENV_MAX_TOKENS_RANGE[1],
    worker_dtype: str = "float32",
    measured: ToplocSpec | None = None,
    sampling_rule: str = "icdf-v1",
) -> RunSpec:
    """The unsigned run spec of a devnet whose coordinator serves at ``http_url``.

    With ``model`` (a local Hugging Face Qwen2 directory) the spec pins it as ``model.base`` with
    its ``base_hash``, dtype and hidden size (TOPLOC's proofs use that hidden size), exactly as
    ``spec init --model-base`` does, and samples with the length-penalty recipe of real task sets
    (an arbitrary model may solve none of the tasks; the length penalty still varies within groups).

    ``rl_overrides`` replaces fields of the ``[rl]`` section (``--rl KEY=VALUE``), checked by
    :class:`~protocol.runspec.RLSpec` like a spec file's. With ``profile`` (``model`` is a
    real-shape profile's directory) the run trains with :data:`PROFILE_RL`, one task per
    submission and :data:`PROFILE_PIECE_BYTES` pieces. Without ``deltas``,
    ``shardcast.max_delta_chain`` is 0: every step is published and fetched in full. With ``env``
    (from :func:`devnet_env`) the run's tasks are that environment's (``data.tasks = "environment"``,
    ``tasks_hash`` pinned), trained like the embedded tasks on the embedded model
    (:func:`env_sampling` with ``env_max_tokens``).

    ``worker_dtype`` (a key of :data:`WORKER_DTYPES`) is what the workers compute in: the spec's
    ``[toploc]`` is :func:`precision_toploc`'s (``measured`` on the base for bf16), bf16 runs get the
    per-worker audit :data:`DEVNET_AUDIT`, and with bf16 workers policies are published in
    bf16 (``model.dtype = "bfloat16"``, as a real run publishes them: the workers' and the
    validators' weights are then the same numbers and only the arithmetic differs; the trainer
    computes in bf16 mixed precision over float32 masters). ``sampling_rule`` is ``sampling.rule``
    (``gumbel-v2`` only with bf16 workers: it is replayed under the logit bound).

    Raises:
        protocol.models.ModelLoadError: ``model`` is not a usable Qwen2 directory (one line naming why).
        pydantic.ValidationError: an override names no ``[rl]`` field or a value out of its bounds.
        ValueError: an unknown ``worker_dtype``.
    """
    if env is not None:
        tasks = ENV_TASKS
    embedded = tasks in ("embedded", ENV_TASKS) and model is None
    rl = devnet_rl(embedded=embedded, async_level=async_level, rl_overrides=rl_overrides, profile=profile)
    sampling = (env_sampling(env_max_tokens) if env is not None else EMBEDDED_SAMPLING) if embedded else REAL_TASKS_SAMPLING
    sampling = sampling.model_copy(update={"rule": sampling_rule})
    toploc = precision_toploc(worker_dtype, measured)
    if profile:
        toploc = ToplocSpec.model_validate(toploc.model_dump() | {"max_near_tie_fraction": PROFILE_MAX_NEAR_TIE_FRACTION})
    model_spec = _model_spec(model)
    bf16 = WORKER_DTYPES[worker_dtype] == "bfloat16"
    if bf16:
        model_spec = model_spec.model_copy(update={"dtype": "bfloat16"})
    return RunSpec(
        run=RunInfo(name="devnet", seed=seed, coordinator=coordinator.peer_id, validators=validators),
        model=model_spec,
        data=DataSpec(tasks=tasks, tasks_hash=tasks_hash,
                      tasks_per_submission=1 if profile else 4 if tasks in ("embedded", ENV_TASKS) else 2),
        env=env if env is not None else EnvSpec(),
        sampling=sampling,
        toploc=toploc,
        rl=rl,
        # keep_steps: async_level + 1 (protocol.window.fresh_steps)
        shardcast=ShardcastSpec(piece_size_bytes=PROFILE_PIECE_BYTES if profile else 256 * 1024, **({} if deltas else {"max_delta_chain": 0})),
        network=NetworkSpec(bootstrap=[bootstrap], ingest_urls=[http_url], origin_urls=[http_url], heartbeat_interval_s=heartbeat_interval_s),
        audit=DEVNET_AUDIT if bf16 else AuditSpec(),
    )


def _model_spec(model: Path | None) -> ModelSpec:
    """``[model]`` of the devnet: the embedded model, or a local directory pinned by its ``base_hash``."""
    if model is None:
        return ModelSpec(base="embedded", hidden_size=128)
    from protocol.models import ModelLoadError, base_hash, inspect_model_dir

    info = inspect_model_dir(model)
    if info.hidden_size < 128:
        raise ModelLoadError(f"{model}: hidden size {info.hidden_size} is below TOPLOC's top-k (128)")
    return ModelSpec(base=str(Path(model).resolve()), base_hash=base_hash(model), hidden_size=info.hidden_size, dtype=info.dtype)
