"""What a node reads from a run spec it was handed (``protocol/runspec.py``): the decoder bounds its
work and names the field, and hostile values of the TOPLOC replay fields are refused.

A run spec arrives from whoever runs the run (or a file anyone can pass): its TOML is bounded in
size, nesting and digits before it is built, and every number the checks depend on is finite and
in range, under the rule it belongs to.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from protocol.errors import RunSpecError
from protocol.identity import NodeKey
from protocol.runspec import ToplocSpec, parse_run_spec

LB = "logit-bound-v1"


@pytest.mark.parametrize("text, why", [
    ("x = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("x = " + "{a=" * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ("[run]\nseed = " + "9" * 5000, "4300 digits"),
    ("#" * (2 << 20), "over the 1048576-byte limit"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_mean = inf\n", "toploc.max_mant_err_mean"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_mant_err_median = nan\n", "toploc.max_mant_err_median"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = nan\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = -1e-4\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nreplay_eps = inf\n", "toploc.replay_eps"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = 1.5\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[toploc]\nmax_near_tie_fraction = nan\n", "toploc.max_near_tie_fraction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = inf\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_cap = 1.0\n", "rl.is_cap"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'clip'\n", "rl.is_correction"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = 'mask'\nold_logprobs = 'behavior'\n", "needs old_logprobs"),
    ("[run]\ncoordinator = '{c}'\n[rl]\nis_correction = ['mask']\n", "rl.is_correction"),
])
def test_run_spec_decoder_bounds_its_work_and_names_the_field(text: str, why: str) -> None:
    text = text.replace("{c}", NodeKey.from_seed(b"c" * 32).peer_id)
    with pytest.raises(RunSpecError, match=why):
        parse_run_spec(text, require_signature=False)


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
def test_hostile_replay_fields_refused(kw: dict) -> None:
    # attacker A5's probes of the replay rule's fields (unknown rule, NaN/inf/huge/negative/nested/bool, fields under the wrong rule)
    with pytest.raises(ValidationError):
        ToplocSpec(**kw)
