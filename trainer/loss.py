"""The INTELLECT-2 GRPO objective, built from named terms (``docs/trainer.md`` §2).

Per completion token *t* with advantage *A* (INTELLECT-2 arXiv 2505.07291 §3.1, "two-sided
token-level clipping")::

    r_t   = exp(logp_t − logp_old_t)                 importance ratio
    c1_t  = min(r_t, δ)                              δ-capped ratio (δ = 4)
    c2_t  = clip(c1_t, 1 − ε, 1 + ε)                 clipped ratio  (ε = 0.2)
    pg_t  = max(−c1_t · A, −c2_t · A)                PPO-style pessimistic surrogate
    kl_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1   k3 estimator of KL(π‖π_ref) (Schulman 2020)
    loss  = Σ_t mask_t · (pg_t + β · kl_t − α · H_t) / norm_tokens

The δ cap matters for negative advantages: without it ``−r·A`` grows without bound as r grows
(PPO's clip does not bound the ratio from above when A < 0); with it the per-token loss is at most
``δ·|A|`` and its gradient is zero for r > δ.

Normalisation is Dr. GRPO's (Liu et al., arXiv 2503.20783 §3.1): the token sum is divided by a
*constant* ``norm_tokens`` (default: rollouts per optimizer step × ``sampling.max_tokens``), not by
each sequence's length nor by the batch's token count, so a token's weight does not depend on the
length of its sequence or on what else landed in the batch, and summing micro-batch (and rank)
losses gives exactly the full-batch loss.

The KL reference ``ref_logprobs`` is whatever the caller supplies: the old policy's log-probs
(``kl_reference = "old"``: a trust-region penalty, free) or a frozen copy of the initial model
(``"base"``). β = 0 (INTELLECT-2's setting) skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossConfig", "LossInputs", "LossOutputs", "grpo_loss", "summarize_metrics"]


@dataclass(frozen=True)
class LossConfig:
    """Constants of the objective (from ``RunSpec.rl``).

    Attributes:
        clip_eps: ε, the ratio is clipped to ``[1 − ε, 1 + ε]``.
        clip_delta: δ > 1, the cap applied to the ratio before clipping.
        kl_beta: β ≥ 0, weight of the KL penalty.
        entropy_coef: α ≥ 0, weight of the entropy bonus.
        norm_tokens: the constant divisor of the token sum (> 0), in tokens.
    """

    clip_eps: float = 0.2
    clip_delta: float = 4.0
    kl_beta: float = 0.0
    entropy_coef: float = 0.0
    norm_tokens: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.clip_delta > 1 + self.clip_eps:
            raise ValueError(f"clip_delta must exceed 1 + clip_eps, got {self.clip_delta}")
        if self.kl_beta < 0 or self.entropy_coef < 0:
            raise ValueError("kl_beta and entropy_coef must be ≥ 0")
        if not self.norm_tokens > 0:
            raise ValueError(f"norm_tokens must be > 0, got {self.norm_tokens}")


@dataclass
class LossInputs:
    """Token-level inputs, flattened over the completion tokens of a micro-batch.

    Attributes:
        logprobs: ``[N] float32`` log π_θ(token) under the current weights (requires grad).
        old_logprobs: ``[N] float32`` log-probs recomputed at the start of the step (no grad).
        advantages: ``[N] float32`` the token's sequence advantage.
        entropy: ``[N] float32`` entropy of π_θ at the token's position, nats; may carry grad
            (needed when ``entropy_coef > 0``), or ``None``.
        ref_logprobs: ``[N] float32`` reference log-probs for the KL term, or ``None``
            (required when ``kl_beta > 0``).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


@dataclass
class LossOutputs:
    """The loss of one micro-batch and its metric *sums* (so micro-batches and ranks add up).

    Attributes:
        loss: scalar float32, ``Σ (pg + β·kl − α·H) / norm_tokens``; backpropagate it as is.
        metrics: scalar float32 tensors, detached: ``tokens`` (N), ``pg_loss_sum``, ``ratio_sum``,
            ``clipped_tokens`` (tokens whose clipped branch is active: zero gradient),
            ``capped_tokens`` (r > δ), ``entropy_sum``, ``kl_sum``. Turn them into means with
            :func:`summarize_metrics`.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


LOG_RATIO_MAX = 20.0
"""Largest log importance ratio exponentiated, nats. Far above ln δ (δ ≤ 1000, ``rl.clip_delta``), so
the capped ratio and every gradient are unchanged; it keeps ``exp`` finite when the behaviour
log-prob is absurdly low (``old_logprobs = "behavior"`` with unchecked worker log-probs of −1e30
made the ratio inf and the weights NaN)."""


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``[N]`` r = exp(min(logp − logp_old, :data:`LOG_RATIO_MAX`))."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, max=LOG_RATIO_MAX))


def capped_ratio(ratio: torch.Tensor, delta: float) -> torch.Tensor:
    """``[N]`` c1 = min(r, δ)."""
    return torch.clamp(ratio, max=delta)


def clipped_ratio(c1: torch.Tensor, eps: float) -> torch.Tensor:
    """``[N]`` c2 = clip(c1, 1 − ε, 1 + ε)."""
    return torch.clamp(c1, 1.0 - eps, 1.0 + eps)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``[N]`` k3 estimator of KL(π_θ ‖ π_ref): exp(ref − logp) − (ref − logp) − 1, ≥ 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def grpo_loss(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """The INTELLECT-2 GRPO loss of one micro-batch (formula in the module docstring).

    Args:
        inputs: token-level tensors, all ``[N]``.
        config: the constants.

    Returns:
        The scalar loss (token sum over ``config.norm_tokens``) and metric sums.

    Raises:
        ValueError: shapes differ, or ``kl_beta > 0`` without ``ref_logprobs``, or
            ``entropy_coef > 0`` without ``entropy``.
    """
    logp, old, adv = inputs.logprobs, inputs.old_logprobs, inputs.advantages
    if not (logp.shape == old.shape == adv.shape) or logp.ndim != 1:
        raise ValueError(f"logprobs {tuple(logp.shape)}, old_logprobs {tuple(old.shape)}, advantages {tuple(adv.shape)} must be equal [N]")
    if config.kl_beta > 0 and inputs.ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    ratio = importance_ratio(logp, old.detach())  # [N]
    c1 = capped_ratio(ratio, config.clip_delta)  # [N]
    c2 = clipped_ratio(c1, config.clip_eps)  # [N]
    unclipped_term = -c1 * adv  # [N]
    clipped_term = -c2 * adv  # [N]
    pg = torch.maximum(unclipped_term, clipped_term)  # [N]
    per_token = pg  # [N]

    zero = logp.new_zeros(())
    kl_sum = zero
    if inputs.ref_logprobs is not None:
        kl = k3_kl(logp, inputs.ref_logprobs.detach())  # [N]
        if config.kl_beta > 0:
            per_token = per_token + config.kl_beta * kl
        kl_sum = kl.detach().sum()
    entropy_sum = zero
    if inputs.entropy is not None:
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * inputs.entropy
        entropy_sum = inputs.entropy.detach().sum()

    loss = per_token.sum() / config.norm_tokens
    metrics = {
        "tokens": torch.tensor(float(logp.numel())),
        "pg_loss_sum": pg.detach().sum(),
        "ratio_sum": ratio.detach().sum(),
        "clipped_tokens": (clipped_term > unclipped_term).sum().to(torch.float32),
        "capped_tokens": (ratio.detach() > config.clip_delta).sum().to(torch.float32),
        "entropy_sum": entropy_sum.to(torch.float32),
        "kl_sum": kl_sum.to(torch.float32),
    }
    return LossOutputs(loss=loss, metrics={k: v.detach().float().cpu() for k, v in metrics.items()})


def summarize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Means from metric sums added over micro-batches and ranks.

    Returns:
        ``clipped_frac``, ``capped_frac``, ``ratio_mean``, ``entropy_mean``, ``kl_mean``,
        ``pg_loss_mean`` (per token), and ``loss_tokens``; zeros when no token was seen.
    """
    n = sums.get("tokens", 0.0)
    d = n if n > 0 else 1.0
    return {
        "loss_tokens": n,
        "clipped_frac": sums.get("clipped_tokens", 0.0) / d,
        "capped_frac": sums.get("capped_tokens", 0.0) / d,
        "ratio_mean": sums.get("ratio_sum", 0.0) / d,
        "entropy_mean": sums.get("entropy_sum", 0.0) / d,
        "kl_mean": sums.get("kl_sum", 0.0) / d,
        "pg_loss_mean": sums.get("pg_loss_sum", 0.0) / d,
    }
