"""Round 4 hostile-input probes: the run spec's new toploc replay fields (attacker A5)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from protocol.runspec import ToplocSpec

LB = "logit-bound-v1"


@pytest.mark.parametrize("kw", [
    {"replay_rule": "x"},
    {"replay_rule": "EPS-V1"},
    {"replay_rule": ["eps-v1"]},
    {"replay_rule": LB, "replay_logit_bound": math.nan},
    {"replay_rule": LB, "replay_logit_bound": math.inf},
    {"replay_rule": LB, "replay_logit_bound": 1e308},
    {"replay_rule": LB, "replay_logit_bound": -1.0},
    {"replay_rule": LB, "replay_logit_bound": {"a": 1}},
    {"replay_rule": LB},  # logit-bound-v1 without a bound
    {"replay_logit_bound": 1.0},  # a bound without its rule
    {"replay_rule": LB, "replay_logit_bound": 1.0, "eos_prob_slack": 0.2},  # eps-v1's field under the other rule
    {"eos_prob_slack": math.nan},
    {"eos_prob_slack": 10**400},
    {"eos_prob_slack": True},
])
def test_hostile_replay_fields_refused(kw):
    with pytest.raises(ValidationError):
        ToplocSpec(**kw)
