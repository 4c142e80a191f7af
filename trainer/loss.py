"""The INTELLECT-2 GRPO objective with an off-policy correction, built from named terms (``docs/trainer.md`` §2).

Per completion token *t* with advantage *A* (INTELLECT-2 arXiv 2505.07291 §3.1, "two-sided
token-level clipping")::

    r_t   = exp(logp_t − logp_old_t)                 PPO ratio against the proximal policy
    c1_t  = min(r_t, δ)                              δ-capped ratio (δ = 4)
    c2_t  = clip(c1_t, 1 − ε, 1 + ε)                 clipped ratio  (ε = 0.2)
    w_t   = exp(logp_old_t − logp_behavior_t)        behavior importance weight (staleness + engine)
    v_t   = correct(w_t)                             truncated, masked or 1 (``is_correction``)
    pg_t  = v_t · max(−c1_t · A, −c2_t · A)          PPO-style pessimistic surrogate, IS-weighted
    kl_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1   k3 estimator of KL(π‖π_ref) (Schulman 2020)
    loss  = Σ_t mask_t · (pg_t + β · kl_t − α · H_t) / norm_tokens

``logp_old`` is the proximal policy of the trust region (``old_logprobs``): ``"recompute"``, the
trainer's own log-probs at the start of the step (INTELLECT-2), or ``"behavior"``, the workers'
sampling log-probs (then ``w ≡ 1``: the ratio itself carries the correction, and ε/δ bound the
trust region around the *behavior* policy). The behavior weight ``w`` corrects a batch sampled by
an older policy (async level k) toward the trainer's; ``correct`` bounds it (``docs/trainer.md`` §2):

* ``"none"``: v = 1 (INTELLECT-2: no correction of staleness);
* ``"truncate"``: v = min(w, C): truncated importance sampling (TIS; Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"; decoupled PPO's behavior
  weight, Hilton et al. arXiv 2110.00641 §3), C = ``is_cap`` = 2;
* ``"mask"``: v = w where 1/C ≤ w ≤ C, else 0: tokens whose weight is extreme are dropped
  (masked importance sampling, as IcePop / MIS).

The δ cap matters for negative advantages: without it ``−r·A`` grows without bound as r grows
(PPO's clip does not bound the ratio from above when A < 0); with it the per-token loss is at most
``δ·|A|`` and its gradient is zero for r > δ. The correction is detached (no gradient through w).

Normalisation is Dr. GRPO's (Liu et al., arXiv 2503.20783 §3.1): the token sum is divided by a
*constant* ``norm_tokens`` (default: rollouts per optimizer step × ``sampling.max_tokens``), not by
each sequence's length nor by the batch's token count, so a token's weight does not depend on the
length of its sequence or on what else landed in the batch, and summing micro-batch (and rank)
losses gives exactly the full-batch loss.

The KL reference ``ref_logprobs`` is whatever the caller supplies: the old policy's log-probs
(``kl_reference = "old"``: a trust-region penalty, free) or a frozen copy of the initial model
(``"base"``). β = 0 (INTELLECT-2's setting) skips it.

The loss also returns the batch's off-policy statistics (how far the trainer is from the policy
that sampled each token): mismatch KL(behavior ‖ trainer), the raw ratio π_trainer / π_behavior
(mean, min, max), the applied weight v and how many tokens the correction truncated or masked.
Metrics are sums (and ``*_min`` / ``*_max`` extremes) that :func:`merge_metrics` combines over
micro-batches and ranks and :func:`summarize_metrics` turns into means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "IS_CORRECTIONS", "OLD_LOGPROBS", "LossConfig", "LossInputs", "LossOutputs", "grpo_loss", "merge_metrics", "summarize_metrics",
]

OLD_LOGPROBS = ("recompute", "behavior")
"""Where the PPO ratio's denominator comes from (``rl.old_logprobs``)."""
IS_CORRECTIONS = ("none", "truncate", "mask")
"""How the behavior importance weight is bounded (``rl.is_correction``)."""


@dataclass(frozen=True)
class LossConfig:
    """Constants of the objective (from ``RunSpec.rl``).

    Attributes:
        clip_eps: ε, the ratio is clipped to ``[1 − ε, 1 + ε]``.
        clip_delta: δ > 1, the cap applied to the ratio before clipping.
        kl_beta: β ≥ 0, weight of the KL penalty.
        entropy_coef: α ≥ 0, weight of the entropy bonus.
        norm_tokens: the constant divisor of the token sum (> 0), in tokens.
        old_logprobs: the ratio's denominator, ``"recompute"`` (trainer log-probs at step start)
            or ``"behavior"`` (the workers' sampling log-probs).
        is_correction: ``"none"``, ``"truncate"`` or ``"mask"`` (module docstring); anything but
            ``"none"`` needs ``old_logprobs = "recompute"`` (with ``"behavior"`` w ≡ 1).
        is_cap: C > 1, the truncation level (``"truncate"``) or the band ``[1/C, C]`` kept
            (``"mask"``) of the behavior weight.
    """

    clip_eps: float = 0.2
    clip_delta: float = 4.0
    kl_beta: float = 0.0
    entropy_coef: float = 0.0
    norm_tokens: float = 1.0
    old_logprobs: str = "recompute"
    is_correction: str = "none"
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.clip_delta > 1 + self.clip_eps:
            raise ValueError(f"clip_delta must exceed 1 + clip_eps, got {self.clip_delta}")
        if self.kl_beta < 0 or self.entropy_coef < 0:
            raise ValueError("kl_beta and entropy_coef must be ≥ 0")
        if not self.norm_tokens > 0:
            raise ValueError(f"norm_tokens must be > 0, got {self.norm_tokens}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {self.is_correction!r}")
        if self.is_correction != "none" and self.old_logprobs != "recompute":
            raise ValueError(f"is_correction {self.is_correction!r} needs old_logprobs 'recompute' (with 'behavior' the ratio is the correction)")
        if not 1 < self.is_cap <= 1e3:
            raise ValueError(f"is_cap must be in (1, 1000], got {self.is_cap}")

    @property
    def needs_recompute(self) -> bool:
        """Whether the loss reads the trainer's recomputed log-probs (``LossInputs.old_logprobs``)."""
        return self.old_logprobs == "recompute"


@dataclass
class LossInputs:
    """Token-level inputs, flattened over the completion tokens of a micro-batch.

    Attributes:
        logprobs: ``[N] float32`` log π_θ(token) under the current weights (requires grad).
        old_logprobs: ``[N] float32`` the trainer's log-probs recomputed at the start of the step
            (no grad); required with ``old_logprobs = "recompute"``, else ``None``.
        advantages: ``[N] float32`` the token's sequence advantage.
        behavior_logprobs: ``[N] float32`` the workers' sampling log-probs of the tokens
            (validated to the policy step they name), or ``None`` (no correction, no off-policy
            statistics); required with ``old_logprobs = "behavior"`` or an ``is_correction``.
        entropy: ``[N] float32`` entropy of π_θ at the token's position, nats; may carry grad
            (needed when ``entropy_coef > 0``), or ``None``.
        ref_logprobs: ``[N] float32`` reference log-probs for the KL term, or ``None``
            (required when ``kl_beta > 0``).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    behavior_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


@dataclass
class LossOutputs:
    """The loss of one micro-batch and its metrics (sums, so micro-batches and ranks add up).

    Attributes:
        loss: scalar float32, ``Σ (pg + β·kl − α·H) / norm_tokens``; backpropagate it as is.
        metrics: scalar float32 tensors, detached. Sums: ``tokens`` (N), ``pg_loss_sum``,
            ``ratio_sum`` (the PPO ratio r), ``clipped_tokens`` (tokens whose clipped branch is
            active: zero gradient), ``capped_tokens`` (r > δ), ``entropy_sum``, ``kl_sum``; the
            off-policy statistics over the tokens with behavior log-probs: ``is_tokens``,
            ``mismatch_kl_sum`` (k3 of KL(behavior ‖ trainer)), ``is_ratio_sum`` (π_trainer /
            π_behavior), ``is_weight_sum`` (the applied weight v), ``is_bounded_tokens`` (tokens
            the correction truncated or masked); extremes ``is_ratio_min``, ``is_ratio_max``,
            ``is_weight_max`` (absent when ``is_tokens`` is 0). Combine with :func:`merge_metrics`,
            turn into means with :func:`summarize_metrics`.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


LOG_RATIO_MAX = 20.0
"""Largest log importance ratio exponentiated, nats. Far above ln δ (δ ≤ 1000, ``rl.clip_delta``) and
ln C (C ≤ 1000, ``rl.is_cap``), so the capped ratio, the bounded weight and every gradient are
unchanged; it keeps ``exp`` finite when the behaviour log-prob is absurdly low (``old_logprobs =
"behavior"`` with unchecked worker log-probs of −1e30 made the ratio inf and the weights NaN)."""


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``[N]`` r = exp(min(logp − logp_old, :data:`LOG_RATIO_MAX`))."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, max=LOG_RATIO_MAX))


def capped_ratio(ratio: torch.Tensor, delta: float) -> torch.Tensor:
    """``[N]`` c1 = min(r, δ)."""
    return torch.clamp(ratio, max=delta)


def clipped_ratio(c1: torch.Tensor, eps: float) -> torch.Tensor:
    """``[N]`` c2 = clip(c1, 1 − ε, 1 + ε)."""
    return torch.clamp(c1, 1.0 - eps, 1.0 + eps)


def behavior_weight(w: torch.Tensor, correction: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N] v, [N] bool bounded)``: the applied importance weight and where the correction changed w.

    Args:
        w: ``[N]`` the behavior importance weight π_old / π_behavior (finite, ≥ 0).
        correction: ``"none"`` (v = 1), ``"truncate"`` (v = min(w, C)) or ``"mask"`` (v = w inside
            ``[1/C, C]``, else 0).
        cap: C > 1.
    """
    if correction == "truncate":
        return torch.clamp(w, max=cap), w > cap
    if correction == "mask":
        keep = (w >= 1.0 / cap) & (w <= cap)  # [N] bool
        return torch.where(keep, w, torch.zeros_like(w)), ~keep
    return torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)


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
        ValueError: shapes differ, or an input the config needs is missing (``old_logprobs`` for
            ``"recompute"``, ``behavior_logprobs`` for ``"behavior"`` or a correction,
            ``ref_logprobs`` for ``kl_beta > 0``, ``entropy`` for ``entropy_coef > 0``).
    """
    logp, adv, behavior = inputs.logprobs, inputs.advantages, inputs.behavior_logprobs
    shapes = [tuple(t.shape) for t in (logp, inputs.old_logprobs, adv, behavior) if t is not None]
    if len(set(shapes)) != 1 or logp.ndim != 1:
        raise ValueError(f"logprobs, old_logprobs, advantages and behavior_logprobs must be equal [N], got {shapes}")
    if config.needs_recompute and inputs.old_logprobs is None:
        raise ValueError("old_logprobs 'recompute' needs the recomputed old_logprobs")
    if (config.old_logprobs == "behavior" or config.is_correction != "none") and behavior is None:
        raise ValueError(f"old_logprobs {config.old_logprobs!r} with is_correction {config.is_correction!r} needs behavior_logprobs")
    if config.kl_beta > 0 and inputs.ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    old = inputs.old_logprobs if config.needs_recompute else behavior
    assert old is not None  # checked above
    ratio = importance_ratio(logp, old.detach())  # [N]
    c1 = capped_ratio(ratio, config.clip_delta)  # [N]
    c2 = clipped_ratio(c1, config.clip_eps)  # [N]
    unclipped_term = -c1 * adv  # [N]
    clipped_term = -c2 * adv  # [N]
    surrogate = torch.maximum(unclipped_term, clipped_term)  # [N]

    zero = logp.new_zeros(())
    metrics: dict[str, torch.Tensor] = {}
    weight = torch.ones_like(surrogate)  # [N] v, 1 without behavior log-probs
    if behavior is not None:
        # the trainer's log-probs before this step's update: recomputed, or this forward's (the same weights)
        trainer_lp = (inputs.old_logprobs if inputs.old_logprobs is not None else logp).detach()  # [N]
        d = torch.clamp(trainer_lp - behavior.detach(), max=LOG_RATIO_MAX).double()  # [N] log π_trainer/π_behavior
        w = d.exp()  # [N] float64
        if config.is_correction != "none":
            v, bounded = behavior_weight(w, config.is_correction, config.is_cap)  # [N], [N] bool
            weight = v.to(surrogate.dtype)
        else:
            v, bounded = torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)
        metrics["is_tokens"] = torch.tensor(float(d.numel()))
        metrics["mismatch_kl_sum"] = (w - d - 1.0).sum()
        metrics["is_ratio_sum"] = w.sum()
        metrics["is_weight_sum"] = v.sum()
        metrics["is_bounded_tokens"] = bounded.sum()
        if d.numel():
            metrics["is_ratio_min"], metrics["is_ratio_max"], metrics["is_weight_max"] = w.min(), w.max(), v.max()
    pg = weight * surrogate  # [N]; v is detached and finite, so A = 0 gives 0 whatever w was
    per_token = pg  # [N]

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
    metrics.update({
        "tokens": torch.tensor(float(logp.numel())),
        "pg_loss_sum": pg.detach().sum(),
        "ratio_sum": ratio.detach().sum(),
        "clipped_tokens": (clipped_term > unclipped_term).sum(),
        "capped_tokens": (ratio.detach() > config.clip_delta).sum(),
        "entropy_sum": entropy_sum,
        "kl_sum": kl_sum,
    })
    return LossOutputs(loss=loss, metrics={k: v.detach().float().cpu() for k, v in metrics.items()})


def merge_metrics(into: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """Add one micro-batch's (or rank's) metrics into ``into``: ``*_min`` keys take the minimum,
    ``*_max`` keys the maximum, every other key is a sum. Returns ``into``."""
    for k, v in metrics.items():
        v = float(v)
        if k.endswith("_min"):
            into[k] = min(into.get(k, v), v)
        elif k.endswith("_max"):
            into[k] = max(into.get(k, v), v)
        else:
            into[k] = into.get(k, 0.0) + v
    return into


def summarize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Means from metrics merged over micro-batches and ranks (:func:`merge_metrics`).

    Returns:
        ``loss_tokens``, ``clipped_frac``, ``capped_frac``, ``ratio_mean``, ``entropy_mean``,
        ``kl_mean``, ``pg_loss_mean`` (per token); zeros when no token was seen. The off-policy
        statistics over the tokens with behavior log-probs: ``mismatch_kl``, ``is_ratio_mean``,
        ``is_ratio_min``, ``is_ratio_max``, ``is_weight_mean``, ``is_weight_max`` and
        ``is_bounded_frac``; 0 for the KL and the fraction, 1 for ratios and weights, when there
        were none.
    """
    n = sums.get("tokens", 0.0)
    d = n if n > 0 else 1.0
    m = sums.get("is_tokens", 0.0)
    e = m if m > 0 else 1.0
    return {
        "loss_tokens": n,
        "clipped_frac": sums.get("clipped_tokens", 0.0) / d,
        "capped_frac": sums.get("capped_tokens", 0.0) / d,
        "ratio_mean": sums.get("ratio_sum", 0.0) / d,
        "entropy_mean": sums.get("entropy_sum", 0.0) / d,
        "kl_mean": sums.get("kl_sum", 0.0) / d,
        "pg_loss_mean": sums.get("pg_loss_sum", 0.0) / d,
        "mismatch_kl": sums.get("mismatch_kl_sum", 0.0) / e,
        "is_ratio_mean": sums.get("is_ratio_sum", 0.0) / m if m > 0 else 1.0,
        "is_ratio_min": sums.get("is_ratio_min", 1.0) if m > 0 else 1.0,
        "is_ratio_max": sums.get("is_ratio_max", 1.0) if m > 0 else 1.0,
        "is_weight_mean": sums.get("is_weight_sum", 0.0) / m if m > 0 else 1.0,
        "is_weight_max": sums.get("is_weight_max", 1.0) if m > 0 else 1.0,
        "is_bounded_frac": sums.get("is_bounded_tokens", 0.0) / e,
    }
