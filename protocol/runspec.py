"""The run spec: one TOML file, signed by the coordinator, that every node of a run loads.

The content (everything except the ``[signature]`` table) is validated against :class:`RunSpec`;
its canonical form is the canonical msgpack of the validated model (so comments, key order and
``1`` vs ``1.0`` do not matter, values do). The **run ID** is the SHA-256 of
``RUN_ID_DOMAIN || canonical content``; the signature is ed25519 by the coordinator key over
``SIGNATURE_DOMAIN || run ID``. See ``docs/protocol.md`` §7.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_validator

from protocol import encoding
from protocol.artifacts import ARTIFACT_NAME_PATTERN
from protocol.envelope import Authorities
from protocol.errors import DecodeError, ProtocolError, RunSpecError, SignatureError
from protocol.identity import PEER_ID_PATTERN, NodeKey, PeerId, public_key_from_peer_id, verify_signature
from protocol.messages import (
    DEFAULT_PIECE_SIZE_BYTES,
    PROOF_MAX_BYTES,
    ROLLOUT_MAX_PROOFS,
    SUBMISSION_MAX_ROLLOUTS,
    PieceSizeBytes,
    Submission,
)
from protocol.toml_depth import first_nesting_over
from protocol.window import fresh_steps

RUN_ID_DOMAIN = b"intellect-node/run-spec/1\x00"
SIGNATURE_DOMAIN = b"intellect-node/run-spec-signature/1\x00"
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_DEPTH = 2 * encoding.MAX_DEPTH
"""Deepest nesting a run spec's TOML may have (32): key parts of the table header (one more for ``[[…]]``), of the
key and one per inline array or table (``protocol.toml_depth``), checked before ``tomllib`` reads the text, whose
work per key grows with its depth (one 15,000-part dotted key: seconds). A spec that validates is at most
``encoding.MAX_DEPTH`` (16) deep, since its run ID is the canonical msgpack of it (``[env.args.chain_sum]`` then
``max_digits = 2``: 4); the limit leaves twice that."""
REPLAY_EPS_DEFAULT = 1e-4
"""Default ``toploc.replay_eps`` (probability units): float32 workers move CDF edges by ≲ 1e-6 and the
check's own rounding by ≤ 7.6e-6 (``docs/toploc.md`` §5.2, §6.1)."""
MAX_NEAR_TIE_FRACTION_DEFAULT = 0.1
"""Default ``toploc.max_near_tie_fraction``: near-tie mismatches allowed per completion, as a share of its tokens."""
EOS_PROB_SLACK_DEFAULT = 0.01
"""Default ``toploc.eos_prob_slack`` (probability units) of the ``eps-v1`` replay: float32 workers and the
validator see P(EOS) differ by ≲ 1e-6."""
REPLAY_RULE_EPS = "eps-v1"
"""Replay rule: a differing token passes where its uniform lies within ``toploc.replay_eps`` (probability
units) of its CDF interval, and P(EOS) may differ by ``toploc.eos_prob_slack`` (``docs/toploc.md`` §6.1)."""
REPLAY_RULE_LOGIT_BOUND = "logit-bound-v1"
"""Replay rule: a token passes where it is the rule's token for *some* logits within ``toploc.replay_logit_bound``
nats of the validator's, up to a common shift (every CDF edge and P(EOS) bounded in log-odds;
``docs/toploc.md`` §6.2): for workers that compute in another dtype than the validator (bf16)."""
REPLAY_RULE_LOGIT_BOUND_V2 = "logit-bound-v2"
"""Replay rule: ``logit-bound-v1``'s per-token window, with the near-tie share judged over a whole submission
and *soft* findings (a finite gap beyond δ, a log-prob or TOPLOC value beyond its bound but within
``toploc.hard_factor`` of it) rejected as ``precision`` (benign: an honest worker's rare numeric tail,
counted by the per-worker audit, never a ban by itself) instead of as cheats (``docs/toploc.md`` §6.3)."""
REPLAY_RULE_LOGIT_BOUND_V3 = "logit-bound-v3"
"""Replay rule: ``logit-bound-v2``, except the log-probs: a completion's log-probs beyond their bounds are a soft
finding at any size (one token's tail: an honest bf16 worker's attention flip errs by up to 4.83 nats in a logit, and
two 40-step devnets under ``-v2`` banned an honest worker for a log-prob 3.6–4.2 nats off; ``docs/devnet.md``
§ Precision), and they are a cheat where their mean absolute difference over the *whole submission* exceeds
``toploc.hard_factor`` × ``toploc.logprob_mean_abs`` (a worker shading its log-probs, not one token's tail;
``docs/toploc.md`` §6.4)."""
REPLAY_RULES = (REPLAY_RULE_EPS, REPLAY_RULE_LOGIT_BOUND, REPLAY_RULE_LOGIT_BOUND_V2, REPLAY_RULE_LOGIT_BOUND_V3)
"""Every replay rule a run spec may name; a spec naming another is refused when parsed."""
LOGIT_BOUND_RULES = (REPLAY_RULE_LOGIT_BOUND, REPLAY_RULE_LOGIT_BOUND_V2, REPLAY_RULE_LOGIT_BOUND_V3)
"""The replay rules whose tolerance is the per-logit bound ``toploc.replay_logit_bound`` (δ, nats)."""
SOFT_RULES = (REPLAY_RULE_LOGIT_BOUND_V2, REPLAY_RULE_LOGIT_BOUND_V3)
"""The replay rules with soft findings (``precision``, benign) and ``toploc.hard_factor`` (``docs/toploc.md`` §6.3)."""
HARD_FACTOR_DEFAULT = 2.0
"""Default ``toploc.hard_factor`` of ``logit-bound-v2``: a value beyond its bound is a cheat only beyond twice it."""
AUDIT_RULE_NONE = "none"
AUDIT_RULE_EPROCESS = "eprocess-v1"
"""Audit rule: per worker, a mixture of likelihood-ratio test martingales over the counts of its verdicts'
replay statistics against the calibrated honest rates; flag when it reaches 1 / ``audit.false_alarm``
(Ville's inequality bounds an honest worker's chance of ever being flagged by it; ``docs/toploc.md`` §11)."""
AUDIT_RULE_EPROCESS_V2 = "eprocess-v2"
"""Audit rule: ``eprocess-v1``'s test, and beside it (half the mixture's weight) a test of the reward
asymmetry of diverged rollouts: validators decode the float32 *twin* of a rollout whose tokens differ
from the replay and count whether the claimed completion out-scores it (up) or the reverse (down); the
coordinator tests the worker's up-share among decisive rollouts against the calibrated honest one
(``docs/toploc.md`` §11.2)."""
AUDIT_RULES = (AUDIT_RULE_EPROCESS, AUDIT_RULE_EPROCESS_V2)
"""The audit rules that audit (every one but ``none``)."""
CALIBRATION_BATCH_LIMIT = 1024
"""Largest decode batch size ``audit.calibration_batches`` may name (the engines' ``max_batch``)."""
CALIBRATION_BATCHES_DEFAULT = (64,)
"""``audit.calibration_batches`` of every spec that does not name it: the one batch-64 configuration the
calibration used before the field existed (the spec keeps its run ID and meaning)."""
CALIBRATION_BATCHES_NEW_RUNS = (1, 8, 64)
"""``audit.calibration_batches`` that ``spec init --audit`` and the bf16 devnet write: a lone worker (batch 1),
a small GPU batch and the devnet's batch (``docs/toploc.md`` §11.1)."""
LOGIT_BOUND_LIMIT = 4.0
"""Upper bound on ``toploc.replay_logit_bound``, nats: beyond it any edge moves by ≥ e⁸ in odds and the replay
no longer says anything about the tokens."""
_HASHED_ONLY_OFF_DEFAULT = {"toploc": ("replay_rule", "replay_logit_bound", "eos_prob_slack", "worker_dtype", "fp32_logits", "hard_factor"),
                           "audit": ("min_calibration_decisive", "twin_share", "calibration_batches")}
"""Fields added after specs were signed: hashed only where they differ from their default, so a spec
signed before them keeps its run ID and means what it meant (the ``eps-v1`` replay, EOS slack 0.01)."""
_SECTIONS_HASHED_ONLY_OFF_DEFAULT = ("audit", "artifacts", "env")
"""Sections added after specs were signed: hashed only where some field differs from its default, so a
spec without them keeps its run ID (it runs no audit, pins no artifacts, has no environment of its own)."""
_SECTIONS_WRITTEN_ONLY_OFF_DEFAULT = ("artifacts", "env")
"""Sections a spec file holds only where off their default (a run without artifacts or its own environment shows no
``[artifacts]`` or ``[env]``)."""
ENV_TASKS = "environment"
"""``data.tasks`` of a run whose tasks come from its ``[env]`` (:class:`EnvSpec`)."""
LOGPROB_TOL_LIMIT = 5.0
"""Upper bound on ``toploc.logprob_*`` tolerances, nats: beyond a factor of e⁵ ≈ 150 in probability
a reported log-prob no longer says anything about the policy."""

HEARTBEAT_MIN_S = 0.1
"""Smallest ``network.heartbeat_interval_s``, seconds. A node's gossip budgets are per heartbeat interval
(``node.p2p.topics``: a forwarder may make it check ``max_records_per_interval`` node records a period), so a
spec of 1e-9 s passed validation and left every node checking signatures for any peer without bound
(2.56e11 records a second at the default 256); at this floor the default allows 2,560 a second."""

PeerIdField = Annotated[PeerId, Field(pattern=f"^{PEER_ID_PATTERN}$")]


class _Section(BaseModel):
    """Base of the spec's tables: no unknown fields, and no coercion between types (``docs/protocol.md`` §7):
    an integer field takes an integer (not ``"64"``, ``true`` or ``64.0``), a bool field a bool, a
    string field a string; a float field also takes an integer (``1`` and ``1.0`` are one value)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunInfo(_Section):
    """Identity of the run."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")] = "devnet"
    seed: Annotated[int, Field(ge=0, le=2**63 - 1, description="run seed: task derivation, sampling seeds")] = 0
    coordinator: PeerIdField = Field(description="peer ID of the coordinator: the run's root of trust")
    validators: Annotated[list[PeerIdField], Field(max_length=256)] = Field(
        default_factory=list, description="peer IDs allowed to sign verdicts"
    )


class ModelSpec(_Section):
    """The policy model (Qwen2 architecture) and its tokenizer."""

    architecture: Annotated[str, Field(pattern=r"^qwen2$")] = "qwen2"
    base: Annotated[str, Field(max_length=512, description="'embedded' or a local directory with config + safetensors")] = "embedded"
    base_hash: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$", description="SHA-256 of the base weights; empty: not pinned")] = ""
    hidden_size: Annotated[int, Field(ge=128, le=1 << 16, description="≥ TOPLOC top-k (128) so every chunk has k entries")] = 128
    dtype: Annotated[str, Field(pattern=r"^(float32|bfloat16)$")] = "float32"


class DataSpec(_Section):
    """The task set."""

    tasks: Annotated[str, Field(min_length=1, max_length=512, description="'embedded', a public set name, or a path")] = "embedded"
    tasks_hash: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    tasks_per_submission: Annotated[int, Field(ge=1, le=1024)] = 2


class EnvSpec(_Section):
    """The run's own environment (``docs/tasks.md`` § Your own environment; ``protocol.envs``): where
    its tasks come from, how prompts are built and how completions are scored, all by the
    environment's code, which every node runs in its sandbox and checks against ``hash``.

    With ``name`` set, ``data.tasks`` is ``"environment"``; empty (the default), the run has no
    environment and this section is neither written nor hashed (old specs keep their run ID).
    """

    name: Annotated[str, Field(max_length=512, description="reasoning_gym:NAME[=W][,NAME...], verifiers:MODULE or a .py file; "
                                                          "empty: no environment")] = ""
    args: Annotated[dict[str, JsonValue], Field(description="the adapter's arguments: reasoning-gym dataset configs by dataset "
                                                            "name, template, answer; verifiers load_environment keywords")] = Field(
        default_factory=dict)
    hash: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$", description="content hash of its files and package versions "
                                                                          "(protocol.envs.pin.environment_hash)")] = ""
    seed: Annotated[int, Field(ge=0, le=2**62, description="seed of its task generator; held-out tasks at seed + 2**32")] = 0
    train_size: Annotated[int, Field(ge=1, le=1_000_000, description="training tasks generated (at most: a task file may hold fewer)")] = 1000
    heldout_size: Annotated[int, Field(ge=0, le=100_000, description="held-out tasks generated (before dropping those a training task "
                                                                     "shares a prompt with)")] = 100

    @field_validator("args")
    @classmethod
    def _small_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            packed = encoding.packb(v)
        except DecodeError as e:  # a ProtocolError, not a ValueError: pydantic would pass it on without the field's name
            raise ValueError(f"env.args has no canonical form: {e}") from None
        if len(packed) > 64 * 1024:
            raise ValueError("env.args is over 64 KiB")
        return v

    @model_validator(mode="after")
    def _named(self) -> EnvSpec:
        if not self.name:
            if any(getattr(self, f) != info.get_default(call_default_factory=True) for f, info in type(self).model_fields.items()):
                raise ValueError("env fields need env.name (the environment they belong to)")
            return self
        from protocol.envs.ref import EnvError, parse_env_ref

        try:
            parse_env_ref(self.name)
        except EnvError as e:
            raise ValueError(str(e)) from None
        if not self.hash:
            raise ValueError("env.hash must pin the environment: write the spec with intellect-node spec init --env NAME, which hashes it")
        return self


class SamplingSpec(_Section):
    """Sampling parameters for generation (semantics: ``docs/toploc.md``)."""

    temperature: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    max_tokens: Annotated[int, Field(ge=1, le=1 << 17, description="tokens")] = 32
    target_lengths: Annotated[list[Annotated[int, Field(ge=1, le=1 << 17)]], Field(max_length=64)] = Field(
        default_factory=list, description="length-control targets in tokens; empty: no length prompt"
    )
    length_penalty: Annotated[float, Field(ge=0.0, le=1.0, description="λ in r − λ·|len − target|")] = 0.0
    rule: Annotated[
        Literal["icdf-v1", "gumbel-v2"],
        Field(description="sampling rule (protocol.sampling, docs/toploc.md §5): icdf-v1, or gumbel-v2 under a logit replay rule"),
    ] = "icdf-v1"


class ToplocSpec(_Section):
    """TOPLOC proof parameters and the verifier thresholds of proofs and sampling (arXiv 2501.16007; ``docs/toploc.md``).

    ``logprob_max_abs`` / ``logprob_mean_abs`` bound how far a worker's reported sampling
    log-probs may lie from the validator's recomputed ones (:func:`protocol.sampling.logprob_check`,
    ``docs/toploc.md`` §8). The defaults (0.01 and 0.001 nats) are for fp32 on both sides: honest
    CPU workers differ by ≤ 1.1e-5 nats per token and ≤ 3.7e-6 on a completion's mean; a run whose
    workers decode in bf16 raises both. Both must be finite, in (0, :data:`LOGPROB_TOL_LIMIT`], with
    mean ≤ max. ``replay_eps`` and ``max_near_tie_fraction`` are the sampling replay's tolerances
    (:func:`protocol.sampling.replay_check`, ``docs/toploc.md`` §6.1); their defaults are for fp32
    workers too, and a run whose workers decode in bf16 raises them (``benchmarks/false_rejections.py``
    measures both). In the signed spec so that every validator and the coordinator's re-check of a
    run apply the same ones.

    ``replay_rule`` names how the replay tolerates numeric noise (:data:`REPLAY_RULES`):
    ``eps-v1`` (the default, for float32 workers) with ``replay_eps`` and ``eos_prob_slack``;
    ``logit-bound-v1`` (for bf16 workers against a float32 validator) with ``replay_logit_bound``,
    the stated per-logit error δ of the workers' compute dtype (``docs/toploc.md`` §6.2). Each
    rule's own fields must be left at their defaults under the other.
    """

    chunk_size: Annotated[int, Field(ge=1, le=1024, description="tokens per proof")] = 32
    topk: Annotated[int, Field(ge=1, le=1024)] = 128
    max_mismatches: Annotated[int, Field(ge=0, le=1024)] = 38
    max_mant_err_mean: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 10.0  # inf: no spec could be hashed (canonical msgpack)
    max_mant_err_median: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 8.0
    eos_min_prob: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    logprob_max_abs: Annotated[
        float,
        Field(gt=0.0, le=LOGPROB_TOL_LIMIT, allow_inf_nan=False,
              description="largest per-token |reported − recomputed| sampling log-prob, nats (docs/toploc.md §8)"),
    ] = 1e-2
    logprob_mean_abs: Annotated[
        float,
        Field(gt=0.0, le=LOGPROB_TOL_LIMIT, allow_inf_nan=False,
              description="largest mean |reported − recomputed| sampling log-prob over one completion, nats; ≤ logprob_max_abs"),
    ] = 1e-3
    replay_eps: Annotated[
        float,
        Field(gt=0.0, le=0.5, allow_inf_nan=False,
              description="sampling replay: a claimed token may differ from the recomputed one only where the uniform lies within "
                          "this distance of its CDF interval, probability units (docs/toploc.md §6.1)"),
    ] = REPLAY_EPS_DEFAULT
    max_near_tie_fraction: Annotated[
        float,
        Field(ge=0.0, le=1.0, allow_inf_nan=False,
              description="sampling replay: such near-tie mismatches allowed per completion, share of its tokens (rounded up)"),
    ] = MAX_NEAR_TIE_FRACTION_DEFAULT
    replay_rule: Annotated[
        Literal["eps-v1", "logit-bound-v1", "logit-bound-v2", "logit-bound-v3"],
        Field(description="how the sampling replay tolerates numeric noise: eps-v1 (replay_eps, eos_prob_slack; float32 workers), "
                          "logit-bound-v1 (replay_logit_bound; workers in another dtype), logit-bound-v2 (v1's window, near ties "
                          "per submission, soft findings up to hard_factor benign) or logit-bound-v3 (v2, with a completion's "
                          "log-probs soft at any size and their submission mean hard) (docs/toploc.md §6)"),
    ] = "eps-v1"
    replay_logit_bound: Annotated[
        float,
        Field(ge=0.0, le=LOGIT_BOUND_LIMIT, allow_inf_nan=False,
              description="logit-bound-v1: the stated largest error of a worker's logit, nats, up to a shift common to the row; "
                          "> 0 under logit-bound-v1, 0 under eps-v1 (docs/toploc.md §6.2)"),
    ] = 0.0
    eos_prob_slack: Annotated[
        float,
        Field(ge=0.0, le=0.5, allow_inf_nan=False,
              description="eps-v1: P(EOS) of worker and validator may differ by this much around eos_min_prob (docs/toploc.md §6.1)"),
    ] = EOS_PROB_SLACK_DEFAULT
    worker_dtype: Annotated[
        Literal["float32", "bfloat16"],
        Field(description="the compute dtype of honest workers that these tolerances were measured for (`spec init --measure-precision`); "
                          "the coordinator's audit calibrates its honest baseline in it (docs/toploc.md §10–§11)"),
    ] = "float32"
    fp32_logits: Annotated[
        bool,
        Field(description="workers computing in bfloat16 take their logits from the float32 LM head (the final-norm row in float32 "
                          "times the head, as validators do): the tolerances were measured so, and honest workers must "
                          "(docs/toploc.md §10)"),
    ] = False
    hard_factor: Annotated[
        float,
        Field(ge=1.0, le=16.0, allow_inf_nan=False,
              description="logit-bound-v2: a log-prob, TOPLOC or EOS value beyond its bound but within this multiple of it is a "
                          "benign `precision` rejection (counted by the audit), beyond it a cheat (docs/toploc.md §6.3)"),
    ] = HARD_FACTOR_DEFAULT

    @model_validator(mode="after")
    def _logprob_tolerances(self) -> ToplocSpec:
        if self.logprob_mean_abs > self.logprob_max_abs:
            raise ValueError(
                f"toploc.logprob_mean_abs {self.logprob_mean_abs} exceeds toploc.logprob_max_abs {self.logprob_max_abs}: "
                "a mean of per-token differences never exceeds their maximum, so that bound would never apply"
            )
        if self.replay_rule in LOGIT_BOUND_RULES:
            if self.replay_logit_bound <= 0.0:
                raise ValueError(f"toploc.replay_rule {self.replay_rule} needs toploc.replay_logit_bound > 0 (nats)")
            if self.replay_eps != REPLAY_EPS_DEFAULT or self.eos_prob_slack != EOS_PROB_SLACK_DEFAULT:
                raise ValueError("toploc.replay_eps and toploc.eos_prob_slack belong to replay rule eps-v1; "
                                 f"under {self.replay_rule} leave them unset (the logit bound sets both)")
        elif self.replay_logit_bound != 0.0:
            raise ValueError("toploc.replay_logit_bound belongs to the logit-bound replay rules; set toploc.replay_rule too")
        if self.hard_factor != HARD_FACTOR_DEFAULT and self.replay_rule not in SOFT_RULES:
            raise ValueError("toploc.hard_factor belongs to replay rules logit-bound-v2 and -v3; set toploc.replay_rule too")
        return self


class RLSpec(_Section):
    """Async GRPO settings: the INTELLECT-2 recipe (arXiv 2505.07291 §3; ``docs/trainer.md``).

    INTELLECT-2 values are the defaults where they fit a one-machine run (ε = 0.2, δ = 4, grad
    clip 0.1, async level 2, KL β = 0, entropy 0); the learning rate, warmup and batch size are
    sized so that a tiny model on a CPU visibly learns (INTELLECT-2: lr 3e-7 on a 32B model,
    group 16).
    """

    async_level: Annotated[int, Field(ge=0, le=64, description="max trainer_step − policy_step")] = 2
    group_size: Annotated[int, Field(ge=2, le=1024, description="rollouts per task")] = 8
    learning_rate: Annotated[float, Field(gt=0.0, le=1.0, description="AdamW peak learning rate (INTELLECT-2: 3e-7)")] = 1e-5
    adam_beta1: Annotated[float, Field(ge=0.0, lt=1.0, description="AdamW β1")] = 0.9
    adam_beta2: Annotated[float, Field(ge=0.0, lt=1.0, description="AdamW β2")] = 0.99
    adam_eps: Annotated[float, Field(gt=0.0, le=1.0, description="AdamW ε")] = 1e-8
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0, description="AdamW decoupled weight decay")] = 0.0
    warmup_steps: Annotated[int, Field(ge=0, le=1 << 20, description="optimizer steps of linear learning-rate warmup from 0")] = 5
    max_grad_norm: Annotated[float, Field(gt=0.0, le=1e6, description="global L2 gradient-norm clip (INTELLECT-2: 0.1)")] = 0.1
    clip_eps: Annotated[float, Field(gt=0.0, lt=1.0, description="ε: the ratio is clipped to [1 − ε, 1 + ε] (INTELLECT-2: 0.2)")] = 0.2
    clip_delta: Annotated[
        float, Field(gt=1.0, le=1e3, description="δ: upper bound on the ratio before clipping, bounds negative-advantage loss (INTELLECT-2: 4)")
    ] = 4.0
    kl_beta: Annotated[float, Field(ge=0.0, le=10.0, description="β of the KL penalty (k3 estimator); 0 disables it (INTELLECT-2: 0)")] = 0.0
    kl_reference: Annotated[
        str, Field(pattern=r"^(old|base)$", description="KL reference: 'old' (log-probs recomputed at step start) or 'base' (frozen initial model)")
    ] = "old"
    old_logprobs: Annotated[
        str,
        Field(pattern=r"^(recompute|behavior)$",
              description="ratio denominator: 'recompute' (INTELLECT-2: trainer log-probs at step start) or 'behavior' (validated worker log-probs; corrects staleness)"),
    ] = "recompute"
    is_correction: Annotated[
        str,
        Field(pattern=r"^(none|truncate|mask)$",
              description="bound on the behavior importance weight π_old/π_behavior (needs old_logprobs 'recompute'): 'none' (INTELLECT-2), "
                          "'truncate' (min(w, is_cap): truncated importance sampling) or 'mask' (tokens with w outside [1/is_cap, is_cap] dropped)"),
    ] = "none"
    is_cap: Annotated[float, Field(gt=1.0, le=1e3, description="C of is_correction: the truncation level or the kept band [1/C, C]")] = 2.0
    entropy_coef: Annotated[float, Field(ge=0.0, le=10.0, description="weight of the entropy bonus; 0 disables it")] = 0.0
    loss_norm_tokens: Annotated[
        int,
        Field(ge=0, le=1 << 40, description="Dr. GRPO loss divisor in tokens; 0: rollouts per optimizer step × sampling.max_tokens"),
    ] = 0
    batch_groups: Annotated[
        int, Field(ge=1, le=1 << 16, description="whole groups per trainer step (batch_groups × group_size rollouts)")
    ] = 4
    optimizer_steps_per_batch: Annotated[
        int, Field(ge=1, le=64, description="optimizer steps per trainer step, each on a slice of whole groups (1: one update per batch)")
    ] = 1
    micro_batch_tokens: Annotated[
        int, Field(ge=16, le=1 << 24, description="tokens per packed micro-batch row (gradient accumulation unit)")
    ] = 2048
    publish_every: Annotated[int, Field(ge=1, le=1 << 20, description="trainer steps between published checkpoints")] = 1
    adv_eps: Annotated[float, Field(gt=0.0, le=1.0, description="ε in A = (r − mean) / (std + ε)")] = 1e-4

    @model_validator(mode="after")
    def _correction_needs_recompute(self) -> RLSpec:
        if self.is_correction != "none" and self.old_logprobs != "recompute":
            raise ValueError(f"is_correction {self.is_correction!r} needs old_logprobs 'recompute' (with 'behavior' the ratio itself is the correction)")
        return self

    @model_validator(mode="after")
    def _steps_fit_batch(self) -> RLSpec:
        if self.optimizer_steps_per_batch > self.batch_groups:
            raise ValueError(
                f"optimizer_steps_per_batch {self.optimizer_steps_per_batch} exceeds batch_groups {self.batch_groups}: "
                "each optimizer step needs at least one whole group"
            )
        return self


class ShardcastSpec(_Section):
    """Checkpoint distribution."""

    piece_size_bytes: PieceSizeBytes = DEFAULT_PIECE_SIZE_BYTES
    keep_steps: Annotated[
        int,
        Field(ge=1, le=1024, description="newest policy steps every node holds (relays' pieces, fetched checkpoints, a validator's "
              "models); ≥ rl.async_level + 1, which it defaults to (protocol.window.fresh_steps)"),
    ] = 3  # the default for the default async level; a spec that does not state it gets fresh_steps(rl.async_level)
    max_delta_chain: Annotated[
        int,
        Field(ge=0, le=64, description="most step deltas a node applies in a row before it fetches the full checkpoint; "
              "0: no deltas. Deltas are published with model.dtype = bfloat16; every published step stays available "
              "in full too (docs/shardcast.md §9)"),
    ] = 4


class NetworkSpec(_Section):
    """Where nodes meet."""

    bootstrap: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] = Field(default_factory=list)
    ingest_urls: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = Field(default_factory=list)
    origin_urls: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = Field(default_factory=list)
    heartbeat_interval_s: Annotated[
        float,
        Field(ge=HEARTBEAT_MIN_S, le=3600.0,
              description="seconds; every node's gossip budgets are per interval (node records one peer may make it check: "
                          "max_records_per_interval / heartbeat_interval_s a second), so it has a floor"),
    ] = 2.0


class AuditSpec(_Section):
    """The per-worker cumulative audit of replay statistics (``docs/toploc.md`` §11; :mod:`protocol.audit`).

    One submission cannot tell a worker that steers its tokens within the replay's window from bf16
    noise; many can. With ``rule = "eprocess-v1"`` the coordinator keeps, per worker, the counts of
    the replay statistics its validators sign into each deciding verdict (tokens replayed, tokens
    that differ from the validator's choice, their gaps beyond fixed fractions of the bound,
    log-probs and TOPLOC chunks beyond their bounds), tests them sequentially against the honest
    rates it measures itself on reference submissions generated in ``toploc.worker_dtype``
    (calibration), and bans a worker whose test reaches ``1 / false_alarm``: its not-yet-trained
    work is withdrawn. ``rule = "eprocess-v2"`` adds the twin test (validators decode the float32
    continuation of each diverged rollout and count whose reward is higher; the coordinator tests the
    worker's share of "up" among decisive rollouts against the calibrated honest share): it sees
    *which* tokens a steerer changed, which a rate test cannot (``docs/toploc.md`` §11.2).
    ``calibration_batches`` names the decode batch sizes the calibration covers (each event's bound the
    largest over them, :class:`protocol.audit.Baseline`); its default ``(64,)`` is the calibration of
    every spec signed before it.
    ``rule = "none"`` (the default, and every spec signed before this section existed): no audit.
    """

    rule: Annotated[Literal["none", "eprocess-v1", "eprocess-v2"],
                    Field(description="the audit: none, eprocess-v1 or eprocess-v2 (docs/toploc.md §11)")] = "none"
    false_alarm: Annotated[
        float, Field(gt=0.0, le=0.01, allow_inf_nan=False,
                     description="largest chance that an honest worker is ever flagged over the run (given a sound baseline)")] = 1e-6
    baseline_confidence: Annotated[
        float, Field(gt=0.0, le=0.01, allow_inf_nan=False,
                     description="chance that a calibrated honest rate is below the true one (one-sided Clopper-Pearson level)")] = 1e-6
    calibration_submissions: Annotated[
        int, Field(ge=0, le=64, description="reference submissions the coordinator generates and checks honestly per new policy step")] = 2
    calibration_window_steps: Annotated[
        int, Field(ge=1, le=1 << 16, description="the baseline pools the calibrations of this many newest policy steps")] = 16
    min_calibration_tokens: Annotated[
        int, Field(ge=0, le=1 << 30, description="no worker is flagged before the baseline holds this many replayed tokens")] = 2000
    min_calibration_decisive: Annotated[
        int, Field(ge=0, le=1 << 20, description="eprocess-v2: the first calibrated step makes reference submissions until the "
                                                 "baseline holds this many decisive (up or down) rollouts, or its burst limit")] = 64
    twin_share: Annotated[
        float, Field(gt=0.0, le=1.0, allow_inf_nan=False,
                     description="eprocess-v2: the share of full checks whose diverged rollouts get float32 twins (validator's own draw; "
                                 "the twins' decode time scales with it, and so does how many tokens a steerer gets before its flag)")] = 1.0
    calibration_batches: Annotated[
        tuple[Annotated[int, Field(ge=1, le=CALIBRATION_BATCH_LIMIT)], ...],
        Field(min_length=1, max_length=8, strict=False,  # a TOML array is a list; its items stay strict ints
              description="decode batch sizes (max_batch) the reference submissions round-robin over: honest replay statistics depend on "
                          "the decode configuration, and each event's bound is the largest over them (docs/toploc.md §11.1)")] = CALIBRATION_BATCHES_DEFAULT

    @field_validator("calibration_batches")
    @classmethod
    def _batches_sorted(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if list(v) != sorted(set(v)):
            raise ValueError(f"audit.calibration_batches must be sorted and unique, got {list(v)}")
        return v


ArtifactName = Annotated[str, Field(pattern=ARTIFACT_NAME_PATTERN)]
ArtifactIdHex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class RunSpec(_Section):
    """The whole run spec (``docs/protocol.md`` §7). Load with :func:`load_run_spec`.

    ``artifacts`` pins, by name, the content-addressed file sets every node fetches over Shardcast
    (:mod:`protocol.artifacts`): ``tasks`` is the training task list (``protocol.dataset``). A spec
    without any hashes exactly as one signed before the table existed (the same run ID).
    """

    run: RunInfo
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    sampling: SamplingSpec = SamplingSpec()
    toploc: ToplocSpec = ToplocSpec()
    rl: RLSpec = RLSpec()
    shardcast: ShardcastSpec = ShardcastSpec()
    network: NetworkSpec = NetworkSpec()
    env: EnvSpec = EnvSpec()
    audit: AuditSpec = AuditSpec()
    artifacts: Annotated[dict[ArtifactName, ArtifactIdHex], Field(max_length=16)] = Field(
        default_factory=dict, description="artifact name → artifact ID (hex): file sets pinned by content (protocol.artifacts)")

    def artifact_id(self, name: str) -> bytes | None:
        """The pinned 32-byte ID of artifact ``name``, or ``None`` when the spec pins none."""
        h = self.artifacts.get(name)
        return bytes.fromhex(h) if h else None

    @model_validator(mode="before")
    @classmethod
    def _default_keep_steps(cls, data: Any) -> Any:
        """A spec that does not state ``shardcast.keep_steps`` keeps :func:`~protocol.window.fresh_steps`
        of its async level (the retention rule, ``protocol.window``); the value is then part of the
        signed content like any stated one."""
        if not isinstance(data, dict):
            return data
        shard, rl = data.get("shardcast"), data.get("rl")
        if isinstance(shard, ShardcastSpec):
            if "keep_steps" in shard.model_fields_set:
                return data
            shard = shard.model_dump()
        elif shard is None:
            shard = {}
        elif not isinstance(shard, dict) or "keep_steps" in shard:
            return data
        k = rl.async_level if isinstance(rl, RLSpec) else rl.get("async_level", RLSpec().async_level) if isinstance(rl, dict) else \
            RLSpec().async_level if rl is None else None
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return data  # an invalid async level: its own error names it
        return {**data, "shardcast": {**shard, "keep_steps": fresh_steps(k)}}

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        if self.model.hidden_size * self.toploc.chunk_size < self.toploc.topk:
            raise ValueError("a TOPLOC chunk must hold at least top-k activations")
        if self.model.hidden_size < self.toploc.topk:
            raise ValueError(f"model.hidden_size {self.model.hidden_size} < toploc.topk {self.toploc.topk}: a last chunk of one token could not be proven")
        if self.toploc.max_mismatches > self.toploc.topk:
            raise ValueError("toploc.max_mismatches exceeds toploc.topk")
        if self.sampling.rule == "gumbel-v2" and self.toploc.replay_rule not in LOGIT_BOUND_RULES:
            raise ValueError("sampling.rule gumbel-v2 is replayed under a logit bound: set toploc.replay_rule logit-bound-v1, -v2 or -v3 "
                             "with toploc.replay_logit_bound (docs/toploc.md §5.3)")
        if (self.data.tasks == ENV_TASKS) != bool(self.env.name):
            raise ValueError('data.tasks "environment" and env.name go together: the tasks of a run with an environment are its own')
        least = fresh_steps(self.rl.async_level)
        if self.shardcast.keep_steps < least:
            raise ValueError(f"shardcast.keep_steps must be ≥ rl.async_level + 1 = {least}")
        self._fits_a_submission()
        return self

    def _fits_a_submission(self) -> None:
        """An honest worker's longest submission must fit ``submission/1`` (``protocol.messages``):
        else every bound here passes and workers decode for hours only to be unable to seal what
        they made (``seal`` refuses it)."""
        rollouts = self.data.tasks_per_submission * self.rl.group_size
        if rollouts > SUBMISSION_MAX_ROLLOUTS:
            raise ValueError(f"data.tasks_per_submission × rl.group_size = {rollouts} rollouts, over the {SUBMISSION_MAX_ROLLOUTS} "
                             "one submission/1 carries")
        proofs = -(-self.sampling.max_tokens // self.toploc.chunk_size)
        if proofs > ROLLOUT_MAX_PROOFS:
            raise ValueError(f"⌈sampling.max_tokens / toploc.chunk_size⌉ = {proofs} proofs per rollout, over the {ROLLOUT_MAX_PROOFS} "
                             "a rollout carries")
        proof_bytes = 2 + 2 * self.toploc.topk  # protocol.toploc.proof_size_bytes (torch-free here; tests tie the two)
        if proof_bytes > PROOF_MAX_BYTES:
            raise ValueError(f"toploc.topk {self.toploc.topk} makes proofs of {proof_bytes} bytes, over the {PROOF_MAX_BYTES} a rollout "
                             f"carries (topk ≤ {(PROOF_MAX_BYTES - 2) // 2})")
        # the completions of max_tokens tokens alone (u32 IDs, f32 log-probs, proofs with their bin headers), prompts not counted
        least_bytes = rollouts * (8 * self.sampling.max_tokens + proofs * (proof_bytes + 3))
        if least_bytes > Submission.MAX_BYTES:
            raise ValueError(f"a submission of {rollouts} rollouts of sampling.max_tokens = {self.sampling.max_tokens} tokens is at "
                             f"least {least_bytes} bytes, over the {Submission.MAX_BYTES} of a submission/1")

    def canonical_bytes(self) -> bytes:
        """Canonical msgpack of the content (what the run ID hashes); the fields of :data:`_HASHED_ONLY_OFF_DEFAULT` and the
        sections of :data:`_SECTIONS_HASHED_ONLY_OFF_DEFAULT` only where off their default."""
        content = self.model_dump(mode="python")
        for section, names in _HASHED_ONLY_OFF_DEFAULT.items():
            fields = type(getattr(self, section)).model_fields
            for name in names:
                if content[section][name] == fields[name].default:
                    del content[section][name]
        for section in _SECTIONS_HASHED_ONLY_OFF_DEFAULT:
            if getattr(self, section) == type(getattr(self, section))():
                del content[section]
        return encoding.packb(content)

    @property
    def run_id(self) -> bytes:
        """32-byte run ID: SHA-256 of the domain tag and the canonical content."""
        return hashlib.sha256(RUN_ID_DOMAIN + self.canonical_bytes()).digest()

    @property
    def authorities(self) -> Authorities:
        """Who may sign coordinator- and validator-only messages in this run."""
        return Authorities(
            coordinator=public_key_from_peer_id(self.run.coordinator),
            validators=frozenset(public_key_from_peer_id(v) for v in self.run.validators),
        )

    def is_validator(self, peer_id: PeerId) -> bool:
        return peer_id in self.run.validators

    @property
    def publishes_deltas(self) -> bool:
        """Whether policies also go out as step deltas: bf16 policies with ``shardcast.max_delta_chain``
        > 0 (``docs/shardcast.md`` §9; fp32 words change too often between steps to pay)."""
        return self.model.dtype == "bfloat16" and self.shardcast.max_delta_chain > 0

    @property
    def delta_chain_limit(self) -> int:
        """Most deltas a node applies in a row to reach a step: ``shardcast.max_delta_chain`` when
        the run publishes deltas (:attr:`publishes_deltas`), else 0 (every step fetched in full)."""
        return self.shardcast.max_delta_chain if self.publishes_deltas else 0


class SignedRunSpec(BaseModel):
    """A run spec with the coordinator's signature over its run ID."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    spec: RunSpec
    signature: bytes

    @property
    def run_id(self) -> bytes:
        return self.spec.run_id


def sign_run_spec(spec: RunSpec, key: NodeKey) -> SignedRunSpec:
    """Sign ``spec`` with the coordinator key.

    Raises:
        RunSpecError: ``key`` is not the spec's coordinator key.
    """
    if key.peer_id != spec.run.coordinator:
        raise RunSpecError(f"key {key.peer_id} is not the spec's coordinator {spec.run.coordinator}")
    return SignedRunSpec(spec=spec, signature=key.sign(SIGNATURE_DOMAIN + spec.run_id))


def dump_run_spec(signed: SignedRunSpec) -> str:
    """The TOML text of a signed spec (content tables, then ``[signature]``)."""
    doc: dict[str, Any] = signed.spec.model_dump(mode="python")
    for section_name in _SECTIONS_WRITTEN_ONLY_OFF_DEFAULT:
        if getattr(signed.spec, section_name) == type(getattr(signed.spec, section_name))():
            del doc[section_name]
    doc["signature"] = {"run_id": signed.run_id.hex(), "ed25519": signed.signature.hex()}
    header = (
        "# intellect-node run spec. Signed by the coordinator: editing any value invalidates it;\n"
        "# re-create it with `intellect-node spec init` and sign it with the coordinator key.\n"
    )
    return header + tomli_w.dumps(doc)


def parse_run_spec(text: str, *, require_signature: bool = True) -> SignedRunSpec:
    """Parse, validate and verify a run spec.

    Raises:
        RunSpecError: over :data:`MAX_SPEC_BYTES`, nested deeper than :data:`MAX_SPEC_DEPTH` (before
            the TOML is parsed), bad TOML (an integer of thousands of digits), a schema violation
            (naming the field), a missing or wrong signature, or a ``run_id`` line that does not
            match the content.
    """
    if len(text) > MAX_SPEC_BYTES:  # characters: at least as many bytes
        raise RunSpecError(f"run spec of {len(text)} characters is over the {MAX_SPEC_BYTES}-byte limit")
    too_deep = first_nesting_over(text, MAX_SPEC_DEPTH)
    if too_deep is not None:
        depth, line = too_deep
        raise RunSpecError(f"run spec is nested too deeply: {depth} levels at line {line} (table header, dotted key and "
                           f"inline arrays or tables together; at most {MAX_SPEC_DEPTH})")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RunSpecError(f"run spec is not valid TOML: {e}") from e
    except RecursionError:  # tomllib recurses once per nesting level; MAX_SPEC_DEPTH keeps it far from the limit
        raise RunSpecError("run spec is not valid TOML: arrays or tables nested too deeply") from None
    except ValueError as e:  # an integer over Python's 4,300-digit conversion limit
        raise RunSpecError(f"run spec is not valid TOML: {str(e)[:120]}") from None
    sig_table = doc.pop("signature", None)
    try:
        spec = RunSpec.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RunSpecError(f"run spec field {where}: {err['msg']}" if where else f"run spec: {err['msg']}") from None
    except ProtocolError as e:
        raise RunSpecError(f"run spec: {e}") from e
    if sig_table is None:
        if require_signature:
            raise RunSpecError("run spec is unsigned (no [signature] table); sign it with the coordinator key")
        return SignedRunSpec(spec=spec, signature=b"")
    if not isinstance(sig_table, dict) or set(sig_table) != {"run_id", "ed25519"}:
        raise RunSpecError("[signature] must hold exactly run_id and ed25519")
    try:
        claimed_id = bytes.fromhex(str(sig_table["run_id"]))
        signature = bytes.fromhex(str(sig_table["ed25519"]))
    except ValueError as e:
        raise RunSpecError("[signature] values must be hex") from e
    if claimed_id != spec.run_id:
        raise RunSpecError("run spec content does not match its signed run ID: it was modified after signing")
    try:
        verify_signature(public_key_from_peer_id(spec.run.coordinator), signature, SIGNATURE_DOMAIN + spec.run_id)
    except (SignatureError, ProtocolError) as e:
        raise RunSpecError(f"run spec signature does not verify for coordinator {spec.run.coordinator}") from e
    return SignedRunSpec(spec=spec, signature=signature)


def load_run_spec(path: Path) -> SignedRunSpec:
    """Read and verify the run spec at ``path`` (see :func:`parse_run_spec`).

    Raises:
        RunSpecError: unreadable, too large, malformed, unsigned or tampered.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunSpecError(f"cannot read run spec {path}: {e.strerror}") from e
    if len(data) > MAX_SPEC_BYTES:
        raise RunSpecError(f"run spec {path} is {len(data)} bytes, over the {MAX_SPEC_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunSpecError(f"run spec {path} is not UTF-8") from e
    try:
        return parse_run_spec(text)
    except RunSpecError as e:
        raise RunSpecError(f"{path}: {e}") from None
