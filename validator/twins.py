"""The float32 twin of a diverged rollout: what the run's seeded sampler would have produced from the
first token where the worker's completion left the validator's replay (``docs/toploc.md`` §11.2).

A rollout whose claimed tokens all equal the replay's choices has no twin (it *is* the replay). For one
that differs first at position ``f`` the twin is the claimed tokens before ``f``, then the replay's own
choice at ``f``, then the validator's own decode in float32 with the same public seeded randomness the
worker must use (:func:`protocol.sampling.sample`: the run's rule, temperature, top-p, EOS gate, keyed
by the rollout's sequence seed and completion position) until EOS or ``sampling.max_tokens``. An honest
worker's divergence is arithmetic noise, blind to the reward, so its completion beats its twin about
as often as the reverse (not exactly: the audit calibrates the honest share); a steerer's divergence
is where it chose a token that helps the reward, so its completion beats its twin almost always.

The validator decodes at most :data:`protocol.audit.TWINS_PER_SUBMISSION` twins per submission, in one
batch (:mod:`validator.pipeline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from protocol import sampling
from protocol.inference import forward, pad_left


@torch.no_grad()
def decode_twins(model: Any, prompts: Sequence[Sequence[int]], prefixes: Sequence[Sequence[int]], seeds: Sequence[int],
                 params: sampling.ReplayParams, max_tokens: int, pad_id: int) -> list[list[int]]:
    """Continue each prefix with the run's seeded sampler on the validator's float32 ``model``, batched.

    Args:
        model: the float32 policy (a ``Qwen2ForCausalLM`` as validators load it).
        prompts: each twin's prompt token IDs (non-empty).
        prefixes: each twin's completion so far, ending with the replay's choice at the first
            differing position (non-empty, ≤ ``max_tokens``).
        seeds: each rollout's sequence seed (the worker's, from the task derivation).
        params: the run's sampling parameters (:meth:`protocol.sampling.ReplayParams.from_spec`).
        max_tokens: ``sampling.max_tokens``.
        pad_id: the tokenizer's padding ID (masked).

    Returns:
        One completion per prefix: the prefix, then the decoded tokens, ending at the first EOS of
        ``params.eos_ids`` or at ``max_tokens`` tokens. A prefix that already ends with EOS or holds
        ``max_tokens`` tokens is returned as is. Work: one prefill of the live rows and at most
        ``max_tokens − min(len(prefix))`` batched decode steps.

    Raises:
        ValueError: mismatched lengths, an empty prompt or prefix, or a prefix longer than ``max_tokens``.
    """
    if not len(prompts) == len(prefixes) == len(seeds):
        raise ValueError("one prompt, prefix and seed per twin")
    if any(not p or not q or len(q) > max_tokens for p, q in zip(prompts, prefixes)):
        raise ValueError(f"need non-empty prompts and prefixes of ≤ {max_tokens} tokens")
    out = [[int(t) for t in q] for q in prefixes]
    eos = set(params.eos_ids)
    live = [i for i, q in enumerate(out) if q[-1] not in eos and len(q) < max_tokens]
    if not live:
        return out
    device = next(model.parameters()).device
    ids, mask, pos = (t.to(device) for t in pad_left([list(prompts[i]) + out[i] for i in live], pad_id))
    step_out = forward(model, ids, mask, pos, use_cache=True, logits_positions=torch.tensor([ids.shape[1] - 1], device=device))
    cache, logits = step_out.cache, step_out.logits[:, -1]  # [B, V] float32
    seed_t = torch.tensor([int(seeds[i]) for i in live], dtype=torch.int64, device=device)  # [B]
    positions = torch.tensor([len(out[i]) for i in live], dtype=torch.int64, device=device)  # [B] completion position sampled next
    next_pos = pos[:, -1:] + 1  # [B, 1]
    done = [False] * len(live)
    for _ in range(max_tokens - min(len(out[i]) for i in live)):
        tok, _ = sampling.sample(logits, seed_t, positions, params.temperature, params.top_p, params.eos_ids, params.min_eos_prob, params.rule)
        for b, t in enumerate(tok.tolist()):
            if done[b]:
                continue
            row = out[live[b]]
            row.append(int(t))
            done[b] = int(t) in eos or len(row) >= max_tokens
        if all(done):
            break
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=device)], dim=1)
        step_out = forward(model, tok.unsqueeze(1), mask, next_pos, cache, use_cache=True)
        cache, logits = step_out.cache, step_out.logits[:, -1]
        positions = positions + 1
        next_pos = next_pos + 1
    return out
