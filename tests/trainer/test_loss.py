"""The INTELLECT-2 GRPO loss against hand-computed values (ε = 0.2, δ = 4)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import LossConfig, LossInputs, grpo_loss, merge_metrics, summarize_metrics

CFG = LossConfig(clip_eps=0.2, clip_delta=4.0, norm_tokens=1.0)

# (advantage, ratio) → (per-token loss, d loss / d logp, clipped branch active, ratio > δ)
# A > 0: loss = max(−c1·A, −c2·A) = −min(c1, c2)·A; gradient −A·r where the unclipped branch is active.
# A < 0: loss = max(c1, c2)·|A|; the δ cap bounds it at δ·|A| and zeroes the gradient.
CASES = [
    # A = +1
    (1.0, 0.5, -0.5, -0.5, False, False),  # below 1 − ε: unclipped (min picks c1 = 0.5)
    (1.0, 1.1, -1.1, -1.1, False, False),  # inside the clip range
    (1.0, 1.5, -1.2, 0.0, True, False),  # above 1 + ε: clipped to 1.2, no gradient
    (1.0, 5.0, -1.2, 0.0, True, True),  # above δ: c1 = 4, clipped to 1.2
    # A = −1
    (-1.0, 0.5, 0.8, 0.0, True, False),  # below 1 − ε: clipped to 0.8, no gradient
    (-1.0, 1.1, 1.1, 1.1, False, False),  # inside
    (-1.0, 1.5, 1.5, 1.5, False, False),  # above 1 + ε: pessimistic branch is unclipped
    (-1.0, 5.0, 4.0, 0.0, False, True),  # above δ: bounded by δ·|A| = 4 (not 5), no gradient
    # A = +2, −0.5: scaling by |A|
    (2.0, 0.7, -1.4, -1.4, False, False),
    (-0.5, 10.0, 2.0, 0.0, False, True),
]


def _inputs(adv: list[float], ratio: list[float], **kw) -> LossInputs:
    logp = torch.tensor([math.log(r) for r in ratio], dtype=torch.float32, requires_grad=True)
    return LossInputs(logprobs=logp, old_logprobs=torch.zeros(len(ratio)), advantages=torch.tensor(adv), **kw)


@pytest.mark.parametrize("adv,ratio,loss,grad,clipped,capped", CASES)
def test_single_token(adv, ratio, loss, grad, clipped, capped) -> None:
    inp = _inputs([adv], [ratio])
    out = grpo_loss(inp, CFG)
    assert out.loss.item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
    out.loss.backward()
    assert inp.logprobs.grad.item() == pytest.approx(grad, rel=1e-5, abs=1e-6)
    assert out.metrics["clipped_tokens"].item() == float(clipped)
    assert out.metrics["capped_tokens"].item() == float(capped)


def test_token_sum_over_constant_and_metrics() -> None:
    adv = [c[0] for c in CASES]
    ratio = [c[1] for c in CASES]
    cfg = LossConfig(clip_eps=0.2, clip_delta=4.0, norm_tokens=20.0)
    out = grpo_loss(_inputs(adv, ratio), cfg)
    expected_sum = sum(c[2] for c in CASES)
    assert out.loss.item() == pytest.approx(expected_sum / 20.0, rel=1e-5)
    m = summarize_metrics({k: float(v) for k, v in out.metrics.items()})
    assert m["loss_tokens"] == len(CASES)
    assert m["clipped_frac"] == pytest.approx(sum(c[4] for c in CASES) / len(CASES))
    assert m["capped_frac"] == pytest.approx(sum(c[5] for c in CASES) / len(CASES))
    assert m["ratio_mean"] == pytest.approx(sum(ratio) / len(ratio), rel=1e-5)


def test_sum_of_micro_batches_equals_full_batch() -> None:
    """Dr. GRPO's constant divisor: splitting tokens into micro-batches changes nothing."""
    adv = [1.0, -1.0, 0.5, 2.0, -0.3]
    ratio = [0.9, 1.3, 1.0, 0.6, 7.0]
    cfg = LossConfig(norm_tokens=10.0)
    full = grpo_loss(_inputs(adv, ratio), cfg).loss.item()
    parts = grpo_loss(_inputs(adv[:2], ratio[:2]), cfg).loss.item() + grpo_loss(_inputs(adv[2:], ratio[2:]), cfg).loss.item()
    assert parts == pytest.approx(full, rel=1e-6)


def test_kl_and_entropy_terms() -> None:
    # ratio 1, A = 0: only KL and entropy contribute
    ref = torch.tensor([math.log(0.5)])  # ref − logp = log 0.5 → k3 = 0.5 − log 0.5 − 1
    k3 = 0.5 - math.log(0.5) - 1.0
    ent = torch.tensor([2.0])
    cfg = LossConfig(kl_beta=0.1, entropy_coef=0.01, norm_tokens=1.0)
    out = grpo_loss(_inputs([0.0], [1.0], ref_logprobs=ref, entropy=ent), cfg)
    assert out.loss.item() == pytest.approx(0.1 * k3 - 0.01 * 2.0, rel=1e-5)
    assert out.metrics["kl_sum"].item() == pytest.approx(k3, rel=1e-5)
    assert out.metrics["entropy_sum"].item() == pytest.approx(2.0)
    # β = 0 and α = 0: the KL and entropy are reported but do not enter the loss
    out0 = grpo_loss(_inputs([0.0], [1.0], ref_logprobs=ref, entropy=ent), LossConfig())
    assert out0.loss.item() == 0.0
    assert out0.metrics["kl_sum"].item() == pytest.approx(k3, rel=1e-5)


def test_errors() -> None:
    with pytest.raises(ValueError, match="kl_beta"):
        grpo_loss(_inputs([1.0], [1.0]), LossConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(_inputs([1.0], [1.0]), LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="must be equal"):
        grpo_loss(LossInputs(torch.zeros(2), torch.zeros(3), torch.zeros(2)), CFG)
    with pytest.raises(ValueError, match="clip_delta"):
        LossConfig(clip_eps=0.2, clip_delta=1.1)
    with pytest.raises(ValueError, match="norm_tokens"):
        LossConfig(norm_tokens=0)


def test_empty_micro_batch_is_zero_and_differentiable() -> None:
    logp = torch.zeros(0, requires_grad=True)
    out = grpo_loss(LossInputs(logp, torch.zeros(0), torch.zeros(0)), CFG)
    assert out.loss.item() == 0.0
    out.loss.backward()


# --- the off-policy correction: behavior log-probs that differ from the trainer's ---------------------

def _off_policy(adv: list[float], w: list[float], cfg: LossConfig, *, ratio: list[float] | None = None) -> tuple[LossInputs, object]:
    """Tokens whose trainer log-probs (recomputed, = current unless ``ratio``) are log 0.5 and whose
    behavior log-probs make π_trainer / π_behavior = ``w``."""
    n = len(adv)
    old = torch.full((n,), math.log(0.5))
    logp = (old + torch.tensor([math.log(r) for r in (ratio or [1.0] * n)])).requires_grad_(True)
    behavior = old - torch.tensor([math.log(x) for x in w])
    inp = LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.tensor(adv), behavior_logprobs=behavior)
    return inp, grpo_loss(inp, cfg)


W = [0.01, 0.4, 0.6, 1.0, 1.9, 3.0, 90.0]
"""Behavior weights π_trainer / π_behavior: far below, below, inside, at, just under, above and far
above the band [1/2, 2] (90 as seen on a devnet step at async level 2)."""


@pytest.mark.parametrize("correction,expected", [
    ("none", [1.0] * len(W)),
    ("truncate", [0.01, 0.4, 0.6, 1.0, 1.9, 2.0, 2.0]),  # min(w, C)
    ("mask", [0.0, 0.0, 0.6, 1.0, 1.9, 0.0, 0.0]),  # w inside [1/C, C], else dropped
])
def test_behavior_weight_is_bounded_as_documented(correction: str, expected: list[float]) -> None:
    """One optimizer step per batch (r = 1): each token's loss and gradient is −v·A, v the bounded weight."""
    cfg = LossConfig(norm_tokens=1.0, old_logprobs="recompute", is_correction=correction, is_cap=2.0)
    for a in (1.0, -1.0):
        inp, out = _off_policy([a] * len(W), W, cfg)
        per_token = torch.autograd.grad(out.loss, inp.logprobs)[0]  # d loss / d logp_t = −v_t·A (r = 1, no clip)
        assert per_token.tolist() == pytest.approx([-v * a for v in expected], rel=1e-5, abs=1e-7)
        assert out.loss.item() == pytest.approx(-a * sum(expected), rel=1e-5)
    m = summarize_metrics({k: float(v) for k, v in out.metrics.items()})
    assert m["is_ratio_max"] == pytest.approx(90.0, rel=1e-4) and m["is_ratio_min"] == pytest.approx(0.01, rel=1e-4)
    assert m["is_ratio_mean"] == pytest.approx(sum(W) / len(W), rel=1e-4)
    assert m["is_weight_max"] == pytest.approx(max(expected), rel=1e-5) and m["is_weight_max"] <= 2.0
    assert m["is_weight_mean"] == pytest.approx(sum(expected) / len(W), rel=1e-5)
    bounded = {"none": 0, "truncate": 2, "mask": 4}[correction]
    assert m["is_bounded_frac"] == pytest.approx(bounded / len(W))
    assert m["mismatch_kl"] == pytest.approx(sum(x - math.log(x) - 1 for x in W) / len(W), rel=1e-4)


def test_weight_multiplies_the_clipped_surrogate() -> None:
    """With r ≠ 1 (a later optimizer step of the batch) the PPO clip acts around the recomputed
    policy and the behavior weight scales what is left: r = 1.5, A = +1 → clipped (no gradient);
    r = 0.5, A = +1 → unclipped, d/dlogp = −v·r."""
    cfg = LossConfig(norm_tokens=1.0, is_correction="truncate", is_cap=2.0)
    inp, out = _off_policy([1.0, 1.0], [90.0, 90.0], cfg, ratio=[1.5, 0.5])
    g = torch.autograd.grad(out.loss, inp.logprobs)[0]
    assert g.tolist() == pytest.approx([0.0, -2.0 * 0.5], rel=1e-5)
    assert out.loss.item() == pytest.approx(-2.0 * 1.2 - 2.0 * 0.5, rel=1e-5)
    assert out.metrics["clipped_tokens"].item() == 1.0


def test_behavior_denominator_needs_no_weight() -> None:
    """``old_logprobs = "behavior"``: the ratio is π_θ / π_behavior itself (two-sided clip with δ
    around the behavior policy); the statistics come from this forward."""
    cfg = LossConfig(norm_tokens=1.0, old_logprobs="behavior")
    logp = torch.full((2,), math.log(0.5), requires_grad=True)
    behavior = logp.detach() - torch.tensor([math.log(90.0), 0.0])
    out = grpo_loss(LossInputs(logprobs=logp, old_logprobs=None, advantages=torch.tensor([-1.0, -1.0]), behavior_logprobs=behavior), cfg)
    g = torch.autograd.grad(out.loss, logp)[0]
    assert g.tolist() == pytest.approx([0.0, 1.0], rel=1e-5)  # r = 90 > δ: capped at δ·|A| = 4, no gradient
    assert out.loss.item() == pytest.approx(4.0 + 1.0, rel=1e-5)
    assert out.metrics["is_ratio_max"].item() == pytest.approx(90.0, rel=1e-4)
    assert out.metrics["is_weight_max"].item() == 1.0 and out.metrics["capped_tokens"].item() == 1.0


@pytest.mark.parametrize("correction", ["none", "truncate", "mask"])
def test_zero_advantage_and_absurd_behavior_logprobs_stay_finite(correction: str) -> None:
    """A token of advantage 0 contributes nothing even when its behavior log-prob is −1e30 (w would
    be inf: the log ratio is clamped before exp, so 0·v stays 0, never NaN); the others are unchanged."""
    cfg = LossConfig(norm_tokens=1.0, is_correction=correction)
    old = torch.full((3,), math.log(0.5))
    logp = old.clone().requires_grad_(True)
    behavior = torch.tensor([-1e30, math.log(0.5), -float("inf")])
    out = grpo_loss(LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.tensor([0.0, 1.0, 0.0]), behavior_logprobs=behavior), cfg)
    g = torch.autograd.grad(out.loss, logp)[0]
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert g.tolist() == pytest.approx([0.0, -1.0, 0.0])
    assert all(math.isfinite(float(v)) for v in out.metrics.values())
    assert out.metrics["is_weight_max"].item() <= (2.0 if correction != "none" else 1.0)


def test_off_policy_metrics_merge_over_micro_batches() -> None:
    """Sums add, extremes take min/max: two halves merged equal the whole batch."""
    cfg = LossConfig(norm_tokens=1.0, is_correction="truncate")
    adv = [1.0, -1.0, 0.5, 2.0, -0.3, 1.0, 0.2]
    whole = {k: float(v) for k, v in _off_policy(adv, W, cfg)[1].metrics.items()}
    merged: dict[str, float] = {}
    merge_metrics(merged, {k: float(v) for k, v in _off_policy(adv[:3], W[:3], cfg)[1].metrics.items()})
    merge_metrics(merged, {k: float(v) for k, v in _off_policy(adv[3:], W[3:], cfg)[1].metrics.items()})
    assert merged.keys() == whole.keys()
    for k, v in whole.items():
        assert merged[k] == pytest.approx(v, rel=1e-5), k
    assert summarize_metrics({})["is_ratio_max"] == 1.0 and summarize_metrics({})["mismatch_kl"] == 0.0


def test_correction_config_errors() -> None:
    with pytest.raises(ValueError, match="needs old_logprobs 'recompute'"):
        LossConfig(old_logprobs="behavior", is_correction="truncate")
    with pytest.raises(ValueError, match="is_correction"):
        LossConfig(is_correction="clip")
    with pytest.raises(ValueError, match="is_cap"):
        LossConfig(is_correction="truncate", is_cap=1.0)
    with pytest.raises(ValueError, match="needs behavior_logprobs"):
        grpo_loss(_inputs([1.0], [1.0]), LossConfig(is_correction="mask"))
    with pytest.raises(ValueError, match="recomputed old_logprobs"):
        grpo_loss(LossInputs(torch.zeros(1), None, torch.zeros(1), behavior_logprobs=torch.zeros(1)), LossConfig())
