"""h43b (issue #33 red team): a claimed EOS that the run's float32 sampler gated (P(EOS) below ``toploc.eos_min_prob``,
inside the logit bound's termination slack) must count in the audit as a differing token.

Found with ``benchmarks/redteam_lab.py aware --mode trigger --trigger '<eos>'``: of 379 EOS an EOS-preferring worker
emitted in 150 submissions, 180 were neither ``differ`` nor any ``gap_over`` event (gap 0, replay token reported as
EOS) although the float32 sampler did not stop there; P(EOS) at those rows lay in [0.0295, 0.098] with floor 0.1,
δ = 0.9835, T = 1.5 (the band [σ(logit f − 2δ/T), f)). Such a stop is free: the audit cannot ration it.
"""

from __future__ import annotations

import math

import pytest
import torch

from protocol import sampling

EOS = 1
V = 32
T = 1.5
FLOOR = 0.1
DELTA = 0.9835


def _logits(p_eos: float) -> torch.Tensor:
    """``[1, V]`` float32 logits whose tempered P(EOS) is ``p_eos``, the rest uniform."""
    z = torch.zeros(1, V, dtype=torch.float64)
    # P(EOS) = e^a / (e^a + V - 1) at temperature T on logits a·T
    a = math.log(p_eos * (V - 1) / (1 - p_eos))
    z[0, EOS] = a * T
    return z.float()


@pytest.mark.xfail(strict=True, reason="open (docs/toploc.md §11.3 What remains (1)): a claimed EOS is replayed with the EOS gate "
                   "off, so a stop the float32 sampler gated is the replay's own token; counting it changes near-tie verdicts "
                   "under v1 and eps-v1, so the fix needs a versioned replay rule")
@pytest.mark.parametrize("rule", [sampling.RULE_ICDF, sampling.RULE_GUMBEL])
def test_gated_eos_claim_counts_as_differing(rule: str) -> None:
    params = sampling.ReplayParams(temperature=T, top_p=1.0, eos_ids=(EOS,), min_eos_prob=FLOOR, rule=rule,
                                   replay_rule="logit-bound-v3", logit_bound=DELTA)
    logits = _logits(0.06)  # gated in float32 (0.06 < 0.1), within the termination slack (σ(logit 0.1 − 2δ/T) ≈ 0.029)
    free = checked = 0
    for seed in range(400):
        honest = int(sampling.sample(logits, torch.tensor([seed]), torch.tensor([0]), T, 1.0, (EOS,), FLOOR, rule)[0][0])
        assert honest != EOS  # the gate holds in float32
        r = sampling.replay_checks(logits, [[EOS]], [seed], params, [0])[0]
        if r.hard_mismatches == 0:  # admissible: then it must at least be counted
            checked += 1
            differs = bool(r.differs[0]) if r.differs is not None else bool(r.gaps[0] > 0)
            free += not differs and float(r.gaps[0]) == 0.0
    assert checked > 0
    assert free == 0, f"{free} of {checked} admissible EOS claims at gated rows pass as the replay's own token (gap 0, not differing)"
