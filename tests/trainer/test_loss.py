"""The INTELLECT-2 GRPO loss against hand-computed values (ε = 0.2, δ = 4)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import LossConfig, LossInputs, grpo_loss, summarize_metrics

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
