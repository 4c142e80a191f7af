"""The devnet's run spec: ``--rl KEY=VALUE`` overrides of its ``[rl]`` section, checked like a spec file's."""

from __future__ import annotations

import pytest

from node.cli import CliError
from node.commands.devnet import _rl_overrides
from node.devnet.config import EMBEDDED_RL, devnet_spec
from protocol.identity import NodeKey


def test_rl_overrides_reach_the_spec() -> None:
    rl = _rl_overrides(["old_logprobs=recompute", "is_correction=truncate", "is_cap=3", "clip_eps=0.1"], embedded=True, async_level=4)
    assert rl == {"old_logprobs": "recompute", "is_correction": "truncate", "is_cap": 3, "clip_eps": 0.1}
    key = NodeKey.generate()
    spec = devnet_spec(key, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=1, async_level=4, rl_overrides=rl)
    assert (spec.rl.async_level, spec.rl.is_correction, spec.rl.is_cap, spec.rl.clip_eps) == (4, "truncate", 3.0, 0.1)
    assert spec.rl.group_size == EMBEDDED_RL.group_size  # the rest is the devnet's own
    assert spec.shardcast.keep_steps >= 5  # the async window's checkpoints stay served


@pytest.mark.parametrize("flags,message", [
    (["bad"], "expected KEY=VALUE"),
    (["no_such_field=1"], "no_such_field"),
    (["is_cap=0.5"], "is_cap"),
    (["is_correction=clip"], "is_correction"),
    # the devnet's own [rl] uses behavior log-probs unless told otherwise: a weight needs recomputed ones
    (["is_correction=mask", "old_logprobs=behavior"], "needs old_logprobs 'recompute'"),
])
def test_bad_rl_overrides_are_refused_with_the_field(flags: list[str], message: str) -> None:
    with pytest.raises(CliError, match=message):
        _rl_overrides(flags, embedded=True, async_level=None)


def test_bf16_workers_get_the_measured_spec_and_the_audit() -> None:
    """``--worker-dtype bf16`` signs the tolerances measured on the base (replay rule ``logit-bound-v2``),
    the per-worker audit and bf16 policies; fp32 keeps the defaults and no audit; a bf16 run without a
    measurement and unknown names are refused."""
    from node.devnet.config import DEVNET_AUDIT, precision_toploc
    from protocol.runspec import AuditSpec, ToplocSpec

    measured = ToplocSpec(replay_rule="logit-bound-v2", replay_logit_bound=1.3, worker_dtype="bfloat16", fp32_logits=True,
                          logprob_max_abs=1.5, logprob_mean_abs=0.5)
    assert precision_toploc("fp32") == precision_toploc("float32") == ToplocSpec()
    assert precision_toploc("bf16", measured) == precision_toploc("bfloat16", measured) == measured
    key = NodeKey.generate()
    spec = devnet_spec(key, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=1, worker_dtype="bf16", measured=measured)
    assert spec.toploc == measured and spec.model.dtype == "bfloat16" and spec.audit == DEVNET_AUDIT and spec.audit.rule == "eprocess-v2"
    plain = devnet_spec(key, [], tasks="embedded", http_url="http://127.0.0.1:1", bootstrap="", seed=1)
    assert plain.toploc == ToplocSpec() and plain.model.dtype == "float32" and plain.audit == AuditSpec()
    with pytest.raises(ValueError, match="measured"):
        precision_toploc("bf16")
    with pytest.raises(ValueError, match="worker dtype"):
        precision_toploc("fp16")
