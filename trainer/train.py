"""The async GRPO trainer: one :meth:`Trainer.train_step` per batch of accepted rollouts.

A trainer step ``n`` (``docs/trainer.md`` §4):

1. split the batch into ``optimizer_steps_per_batch`` slices of whole groups;
2. per slice, take this rank's share of sequences (balanced by tokens) and pack it into
   micro-batch rows; ranks with fewer rows get padding rows so every rank runs the same number of
   forwards (FSDP2 collectives);
3. recompute the old log-probs of every row with the current weights, under ``no_grad``, with
   the same forward used for the new ones (INTELLECT-2 §3.1); for ``kl_reference = "base"`` also
   the frozen base model's (skipped when the ratio's denominator is the workers' behavior
   log-probs and there is no KL term: nothing would read them);
4. per slice: forward/backward each row (gradient accumulation; each row's loss is its token sum
   over the constant ``norm_tokens``, scaled by the world size because FSDP2 averages gradients
   over ranks), clip the global gradient norm, AdamW step with linear warmup;
5. ``step`` becomes ``n + 1``: the weights are policy step ``n + 1``.

Works in one process (plain module) or under ``torchrun`` with FSDP2 (see ``trainer.model``).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2ForCausalLM

from protocol.runspec import RunSpec
from trainer.batch import Batch, MicroBatch, TrainSequence, pack_sequences, shard_sequences
from trainer.checkpoint import load_training_state, save_policy, save_training_state
from trainer.distributed import DistContext, all_reduce_max, all_reduce_sum
from trainer.loss import LossConfig, LossInputs, grpo_loss, merge_metrics, summarize_metrics
from trainer.model import shard_model, token_logprobs

logger = logging.getLogger(__name__)

__all__ = ["StepMetrics", "Trainer", "TrainerConfig"]


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the trainer needs, resolved from the run spec (see :meth:`from_spec`).

    Attributes:
        learning_rate: AdamW peak learning rate.
        adam_betas: (β1, β2).
        adam_eps: AdamW ε.
        weight_decay: decoupled weight decay.
        warmup_steps: optimizer steps of linear warmup from 0 to ``learning_rate``.
        max_grad_norm: global L2 gradient-norm clip.
        loss: the GRPO loss constants (``norm_tokens`` resolved).
        kl_reference: ``"old"`` or ``"base"``.
        micro_batch_tokens: packed row capacity, tokens.
        optimizer_steps_per_batch: optimizer steps per trainer step.
        temperature: sampling temperature the workers used (logits are divided by it).
        compute_dtype: ``"float32"`` or ``"bfloat16"`` (FSDP2 mixed precision; masters stay float32).
        pad_token_id: token of padding rows.
    """

    learning_rate: float = 1e-5
    adam_betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 0.1
    loss: LossConfig = field(default_factory=LossConfig)
    kl_reference: str = "old"
    micro_batch_tokens: int = 2048
    optimizer_steps_per_batch: int = 1
    temperature: float = 1.0
    compute_dtype: str = "float32"
    pad_token_id: int = 0

    @classmethod
    def from_spec(cls, spec: RunSpec) -> TrainerConfig:
        """The trainer settings of a run spec.

        ``norm_tokens`` = ``rl.loss_norm_tokens``, or when 0: rollouts per optimizer step
        (``batch_groups × group_size / optimizer_steps_per_batch``) × ``sampling.max_tokens``.
        """
        rl = spec.rl
        norm = rl.loss_norm_tokens or (rl.batch_groups * rl.group_size / rl.optimizer_steps_per_batch) * spec.sampling.max_tokens
        return cls(
            learning_rate=rl.learning_rate,
            adam_betas=(rl.adam_beta1, rl.adam_beta2),
            adam_eps=rl.adam_eps,
            weight_decay=rl.weight_decay,
            warmup_steps=rl.warmup_steps,
            max_grad_norm=rl.max_grad_norm,
            loss=LossConfig(
                clip_eps=rl.clip_eps, clip_delta=rl.clip_delta, kl_beta=rl.kl_beta, entropy_coef=rl.entropy_coef, norm_tokens=float(norm),
                old_logprobs=rl.old_logprobs, is_correction=rl.is_correction, is_cap=rl.is_cap,
            ),
            kl_reference=rl.kl_reference,
            micro_batch_tokens=rl.micro_batch_tokens,
            optimizer_steps_per_batch=rl.optimizer_steps_per_batch,
            temperature=spec.sampling.temperature,
            compute_dtype=spec.model.dtype,
        )


@dataclass
class StepMetrics:
    """What one trainer step reports (identical on every rank).

    Attributes:
        step: the trainer step completed (weights are now policy ``step``).
        loss: the summed loss over the batch (Σ over optimizer steps of their full-batch loss).
        grad_norm: global gradient L2 norm before clipping (mean over the step's optimizer steps).
        lr: learning rate of the last optimizer step.
        clipped_frac: fraction of loss tokens whose clipped branch was active (zero gradient).
        capped_frac: fraction of loss tokens with ratio > δ.
        ratio_mean: mean importance ratio.
        entropy_mean: mean policy entropy over loss tokens, nats.
        kl_mean: mean k3 KL to the reference (0 when no reference was computed).
        loss_tokens: completion tokens trained on.
        tokens: all tokens forwarded (prompts included, padding rows excluded).
        tokens_per_s: ``tokens`` over the step's wall time.
        step_time_s: wall time of the step, seconds.
        micro_batches: rows this rank processed (padding included).
        reward_mean: batch statistic, see :class:`~trainer.batch.Batch`.
        pass_rate: batch statistic (``task_reward == 1`` fraction).
        completion_len_mean: batch statistic, tokens.
        num_groups: groups trained.
        num_rollouts: rollouts trained.
        zero_advantage_groups: groups filtered out by online filtering.
        staleness: ``step − policy_step`` → rollouts, for the trained rollouts.
        mismatch_kl: mean over loss tokens of the k3 estimate of KL(behavior ‖ trainer),
            ``exp(d) − d − 1`` with ``d = log π_trainer − log π_behavior``: how far the trainer's
            log-probs of the sampled tokens (current weights, before this step's update) are from
            the workers' sampling log-probs (staleness plus any engine mismatch; prime-rl logs the
            same as ``mismatch_kl``). 0 when the batch has no loss tokens.
        is_ratio_mean, is_ratio_min, is_ratio_max: the per-token importance ratio
            ``π_trainer / π_behavior`` over loss tokens (mean, min, max), before any bound.
        is_weight_mean, is_weight_max: the behavior importance weight the loss applied per token
            (``rl.is_correction``: truncated at ``rl.is_cap``, masked, or 1), mean and max.
        is_bounded_frac: fraction of loss tokens whose weight the correction truncated or masked.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    clipped_frac: float
    capped_frac: float
    ratio_mean: float
    entropy_mean: float
    kl_mean: float
    loss_tokens: int
    tokens: int
    tokens_per_s: float
    step_time_s: float
    micro_batches: int
    reward_mean: float
    pass_rate: float
    completion_len_mean: float
    num_groups: int
    num_rollouts: int
    zero_advantage_groups: int
    staleness: dict[int, int]
    mismatch_kl: float = 0.0
    is_ratio_mean: float = 1.0
    is_ratio_min: float = 1.0
    is_ratio_max: float = 1.0
    is_weight_mean: float = 1.0
    is_weight_max: float = 1.0
    is_bounded_frac: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (staleness keys become strings)."""
        d = asdict(self)
        d["staleness"] = {str(k): v for k, v in self.staleness.items()}
        return d


class Trainer:
    """GRPO trainer over a Qwen2 policy (plain, or FSDP2-sharded when ``ctx.world_size > 1``).

    Attributes:
        model: the policy (sharded in place when distributed).
        optimizer: AdamW over its parameters.
        config: the settings.
        ctx: where this rank sits.
        step: trainer steps completed = policy step of the current weights.
        optimizer_steps: optimizer steps completed (drives warmup).
    """

    model: Qwen2ForCausalLM
    optimizer: torch.optim.AdamW
    config: TrainerConfig
    ctx: DistContext
    step: int
    optimizer_steps: int

    def __init__(self, model: Qwen2ForCausalLM, config: TrainerConfig, ctx: DistContext | None = None, *, step: int = 0) -> None:
        """Take ownership of ``model``: move it to the device, shard it if distributed, build AdamW.

        In a group, every rank passes a model of the same architecture; rank 0's weights are
        broadcast to all, so the others' initial values do not matter.

        Args:
            model: an unsharded float32 Qwen2 policy (``protocol.models.build_model`` or ``load_model``).
            config: the settings.
            ctx: the distributed context; ``None``: a single process on CPU.
            step: the policy step of the given weights (a resumed run overwrites it in ``load_state``).
        """
        self.config = config
        self.ctx = ctx or DistContext()
        self.step = step
        self.optimizer_steps = 0
        model.config.use_cache = False
        model.to(self.ctx.device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self from mypy
        model.train()
        self._ref_model: torch.nn.Module | None = None
        if config.loss.kl_beta > 0 and config.kl_reference == "base":
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
            self._ref_model = ref
        if self.ctx.distributed:
            self._shard(model)
            if self._ref_model is not None:
                self._shard(self._ref_model)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.learning_rate,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            foreach=True,
        )
        n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global size
        n_local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        logger.info("trainer ready: %d parameters, %d on this rank (local shard), world size %d, step %d", n_params, n_local,
                    self.ctx.world_size, step)

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {k: v.detach().clone() for k, v in model.state_dict().items()} if self.ctx.is_main else {}
        dtype = torch.bfloat16 if self.config.compute_dtype == "bfloat16" else torch.float32
        shard_model(model, self.ctx.mesh, compute_dtype=dtype)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def lr_at(self, optimizer_step: int) -> float:
        """Learning rate of optimizer step ``optimizer_step`` (0-based): linear warmup, then constant."""
        w = self.config.warmup_steps
        if w <= 0:
            return self.config.learning_rate
        return self.config.learning_rate * min(1.0, (optimizer_step + 1) / w)

    def _micro_batches(self, sequences: list[TrainSequence]) -> list[MicroBatch]:
        """This rank's packed rows for one slice, padded to the group-wide maximum row count."""
        mine = shard_sequences(sequences, self.ctx.world_size, self.ctx.rank)
        rows = pack_sequences(mine, self.config.micro_batch_tokens)
        n = len(rows)
        if self.ctx.distributed:
            n = int(all_reduce_max(n, self.ctx))
        rows += [MicroBatch.padding(self.config.pad_token_id) for _ in range(n - len(rows))]
        return [r.to(self.ctx.device) for r in rows]

    def _logprobs(self, model: torch.nn.Module, rows: list[MicroBatch]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [token_logprobs(model, mb, temperature=self.config.temperature, with_entropy=False)[0] for mb in rows]

    def train_step(self, batch: Batch) -> StepMetrics:
        """Train on one batch (every rank passes the same batch; see ``broadcast_batch``). Collective.

        Args:
            batch: whole groups with advantages, from :func:`~trainer.batch.assemble_batch`.

        Returns:
            The step's metrics (same values on every rank).

        Raises:
            ValueError: the batch has fewer groups than ``optimizer_steps_per_batch``.
        """
        t0 = time.perf_counter()
        cfg = self.config
        slices = [self._micro_batches(s) for s in batch.slices(cfg.optimizer_steps_per_batch)]
        self.model.train()
        # behavior log-probs with no KL term need no separate no-grad forward: the loss then takes the
        # trainer's side of the off-policy statistics from the first forward of each row (detached, the same weights)
        need_recompute = cfg.loss.needs_recompute or (cfg.loss.kl_beta > 0 and self._ref_model is None)
        recomputed = [self._logprobs(self.model, rows) for rows in slices] if need_recompute else None  # [K][rows] of [1, T]
        ref: list[list[torch.Tensor]] | None = None  # the KL reference, [K][rows] of [1, T]; only with kl_beta > 0
        if cfg.loss.kl_beta > 0:  # with no reference model need_recompute holds: the current weights are the reference
            ref = [self._logprobs(self._ref_model, rows) for rows in slices] if self._ref_model is not None else recomputed
        world = float(self.ctx.world_size)
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        lr = self.lr_at(self.optimizer_steps)
        for k, rows in enumerate(slices):
            lr = self.lr_at(self.optimizer_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(rows):
                logp, ent = token_logprobs(self.model, mb, temperature=cfg.temperature, with_entropy=True)  # [1, T] each
                mask = mb.loss_mask[0]  # [T] bool
                entropy = ent[0][mask] if ent is not None else None  # [N]
                inputs = LossInputs(
                    logprobs=logp[0][mask],  # [N]
                    old_logprobs=recomputed[k][j][0][mask] if recomputed is not None else None,  # [N]
                    advantages=mb.advantages[0][mask],  # [N]
                    behavior_logprobs=mb.behavior_logprobs[0][mask],  # [N]
                    entropy=entropy if cfg.loss.entropy_coef > 0 or entropy is None else entropy.detach(),
                    ref_logprobs=ref[k][j][0][mask] if ref is not None else None,  # grpo_loss refuses kl_beta > 0 without it
                )
                out = grpo_loss(inputs, cfg.loss)
                (out.loss * world).backward()
                merge_metrics(sums, {"loss": float(out.loss.detach()), **{name: float(v) for name, v in out.metrics.items()}})
                # every rank reports the same keys (a padding row forwards no data tokens)
                merge_metrics(sums, {"tokens_fwd": float(mb.num_tokens) if int(mb.sequence_index[0, 0]) >= 0 else 0.0})
            grad_norms.append(self._clip_and_step())
        self.step += 1
        totals = _all_reduce_metrics(sums, self.ctx)
        means = summarize_metrics(totals)
        elapsed = time.perf_counter() - t0
        metrics = StepMetrics(
            step=self.step,
            loss=totals.get("loss", 0.0),
            grad_norm=sum(grad_norms) / len(grad_norms),
            lr=lr,
            clipped_frac=means["clipped_frac"],
            capped_frac=means["capped_frac"],
            ratio_mean=means["ratio_mean"],
            entropy_mean=means["entropy_mean"],
            kl_mean=means["kl_mean"],
            loss_tokens=round(means["loss_tokens"]),
            tokens=round(totals.get("tokens_fwd", 0.0)),
            tokens_per_s=totals.get("tokens_fwd", 0.0) / elapsed if elapsed > 0 else 0.0,
            step_time_s=elapsed,
            micro_batches=sum(len(r) for r in slices),
            reward_mean=batch.reward_mean,
            pass_rate=batch.pass_rate,
            completion_len_mean=batch.completion_len_mean,
            num_groups=len(batch.group_keys),
            num_rollouts=len(batch.sequences),
            zero_advantage_groups=len(batch.zero_advantage_groups),
            staleness=batch.staleness_histogram(),
            mismatch_kl=means["mismatch_kl"],
            is_ratio_mean=means["is_ratio_mean"],
            is_ratio_min=means["is_ratio_min"],
            is_ratio_max=means["is_ratio_max"],
            is_weight_mean=means["is_weight_mean"],
            is_weight_max=means["is_weight_max"],
            is_bounded_frac=means["is_bounded_frac"],
        )
        logger.info(
            "step %d: loss %.5f grad_norm %.4f reward %.3f pass %.3f clipped %.3f entropy %.3f %.0f tok/s",
            metrics.step,
            metrics.loss,
            metrics.grad_norm,
            metrics.reward_mean,
            metrics.pass_rate,
            metrics.clipped_frac,
            metrics.entropy_mean,
            metrics.tokens_per_s,
        )
        return metrics

    def _clip_and_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        full = getattr(norm, "full_tensor", None)
        value = float(full() if callable(full) else norm)
        self.optimizer.step()
        self.optimizer_steps += 1
        return value

    def save_checkpoint(
        self, directory: Path, *, dtype: torch.dtype = torch.float32, tokenizer: Any = None, base_dir: Path | None = None
    ) -> list[Path]:
        """Write the current policy as a model directory for publishing (``trainer.checkpoint.save_policy``,
        which writes with ``protocol.models.save_model``: weights in ``dtype``, the base's config and
        other files when ``base_dir`` is given, else the tokenizer's files). Collective; rank 0
        gathers the full weights (CPU offload) and writes.

        Returns:
            The written paths, sorted, on rank 0; ``[]`` elsewhere.
        """
        return save_policy(self.model, Path(directory), self.ctx, dtype=dtype, tokenizer=tokenizer, base_dir=base_dir)

    def save_state(self, root: Path, data_position: dict[str, Any] | None = None, *, keep: int = 2) -> Path:
        """Save weights, optimizer state, step counters, RNG states and ``data_position`` under
        ``root/step-<step>`` (:mod:`protocol.step_dirs`) and point ``root/latest`` at it. Collective; rank 0 writes.

        Returns:
            The state directory.
        """
        return save_training_state(
            self.model,
            self.optimizer,
            Path(root),
            self.ctx,
            step=self.step,
            optimizer_steps=self.optimizer_steps,
            data_position=data_position,
            keep=keep,
        )

    def load_state(self, path: Path) -> dict[str, Any]:
        """Resume from a state directory (or a root with ``latest``). Collective.

        Returns:
            The saved ``data_position`` (on rank 0; ``{}`` on other ranks).

        Raises:
            StateError: missing or corrupt files, or a state of another model shape.
        """
        info = load_training_state(self.model, self.optimizer, Path(path), self.ctx)
        self.step = info["step"]
        self.optimizer_steps = info["optimizer_steps"]
        return dict(info["data_position"])


def _all_reduce_metrics(values: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Metrics merged over ranks as :func:`~trainer.loss.merge_metrics` merges micro-batches: ``*_min``
    keys by minimum, ``*_max`` keys by maximum, the rest summed (identity in a single process).
    Collective: every rank passes the same keys (a rank with no off-policy tokens passes the
    neutral ±inf for the extremes)."""
    if not ctx.distributed:
        return dict(values)
    import torch.distributed as dist

    names = {"is_ratio_min", "is_ratio_max", "is_weight_max"}  # every rank must reduce the same keys
    vals = dict(values)
    for k in names:
        vals.setdefault(k, float("inf") if k.endswith("_min") else float("-inf"))
    extremes = sorted(names)
    sums = all_reduce_sum({k: v for k, v in vals.items() if k not in names}, ctx)
    t = torch.tensor([-vals[k] if k.endswith("_min") else vals[k] for k in extremes], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = {**sums, **{k: (-x if k.endswith("_min") else x) for k, x in zip(extremes, t.cpu().tolist())}}
    return {k: v for k, v in out.items() if abs(v) != float("inf")}
